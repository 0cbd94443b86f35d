"""`decode_kernel`, the float32 CPU engine's decode-step attention in C, against the matmuls it replaces, on the
layouts the engine hands it; and what happens where it cannot be built."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from relax_gym.cpu import decode_kernel
from relax_gym.cpu.decode_attention import decode_attention, grouped_matmuls


class _Heads(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 16), (4, 4, 32), (8, 2, 64)])
def test_it_attends_as_the_matmuls_do_over_a_cache_with_room(heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(heads)
    rows, length = 5, 11
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    # the engine's keys and values are views of buffers with room to grow (`continuous.SlackLayer`)
    key = torch.randn(rows, kv_heads, length + 7, dim, generator=generator)[:, :, :length]
    value = torch.randn(rows, kv_heads, length + 7, dim, generator=generator)[:, :, :length]
    keep = torch.ones(rows, 1, 1, length + 2, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding
    keep[3, ..., 2:6] = False  # a hole between a shared prefix and a prompt's own tokens
    module = _Heads(heads // kv_heads)
    for mask in (None, keep, keep[:1].expand(rows, -1, -1, -1), keep[:1]):
        ours = decode_kernel.attend(query, key, value, mask, 0.3)
        assert ours is not None and ours.shape == (rows, 1, heads, dim)
        theirs = grouped_matmuls(query, key, value, mask, 0.3)
        assert torch.allclose(ours, theirs, atol=1e-6)
        assert torch.equal(decode_attention(module, query, key, value, mask, 0.0, 0.3)[0], ours)


def test_it_leaves_what_it_does_not_do_to_the_matmuls():
    query, key, value = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    additive = torch.zeros(2, 1, 1, 5)
    assert decode_kernel.attend(query, key, value, additive, 1.0) is None  # a float mask is added, not kept
    assert decode_kernel.attend(query.bfloat16(), key.bfloat16(), value.bfloat16(), None, 1.0) is None
    assert decode_kernel.attend(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, None, 1.0) is None
    assert decode_kernel.attend(query, key[:1].expand(2, -1, -1, -1), value, None, 1.0) is not None  # strided rows
    assert decode_kernel.attend(query, key[:1], value[:1], None, 1.0) is None  # rows to broadcast: not its job


def test_it_runs_on_the_openmp_runtime_torch_loaded():
    assert decode_kernel.build(3, 16) is not None
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "/libgomp" in line}
    assert len(runtimes) == 1, runtimes  # one pool of workers, which `release_openmp_workers` ends


def test_without_a_compiler_it_says_so_once_and_the_matmuls_answer(monkeypatch, caplog):
    query, key, value = torch.randn(2, 6, 1, 24), torch.randn(2, 2, 5, 24), torch.randn(2, 2, 5, 24)
    expected = grouped_matmuls(query, key, value, None, 0.5)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    decode_kernel.build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="relax_gym.engines"):
            for _ in range(2):
                assert torch.equal(decode_attention(_Heads(3), query, key, value, None, 0.0, 0.5)[0], expected)
        warnings = [r.getMessage() for r in caplog.records if "C kernel" in r.getMessage()]
        assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0]
    finally:
        decode_kernel.build.cache_clear()  # the next test builds with the real compiler again


def test_building_it_leaves_the_loading_threads_floating_point_alone():
    """Linked with `-ffast-math`, the library would turn on flush-to-zero in the thread that loads it, and every
    float op that thread runs after would lose its denormals (hypothesis refuses to run then)."""
    code = ("import torch; from relax_gym.cpu import decode_kernel; assert decode_kernel.build(2, 8); "
            "print(5e-324 * 1.0 > 0, (torch.tensor([1e-40]) * 1.0).item() > 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True"]
