"""Distributed weight publication: the trainer (rank 0) broadcasts to two real `relax-gym serve` servers over
gloo, driven through SGLang's routes by the same client code that drives SGLang.

The servers run in threads of this process (as `serving` runs them) and the trainer in the test's thread:
three ranks of one group in three threads, which gloo allows. Each server holds its own tiny model, so
its weights can be compared with what the trainer sent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta

import httpx
import pytest
import torch
from support.engines import KEY, free_port, get, post, serving, weight_session

from relax_gym.engines import EmbeddedEngine, EngineError, SGLangEngine
from relax_gym.engines.weight_group import create_group, dtype_name, join_group, open_store, parse_dtype
from relax_gym.models import load_model
from relax_gym.trainer.weight_publish import ONE_GPU_EACH, DistributedPublisher

GROUP = "relax-gym-weights"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[tuple[str, EmbeddedEngine]]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serving(load_model("tiny"))) for _ in range(2)]


def _shifted(engine: EmbeddedEngine, by: float, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The trainer's weights: the served ones moved by `by`, so an update shows."""
    return {k: (v.detach() + by).to(dtype or v.dtype) for k, v in engine.model.state_dict().items()}


def _holds(engine: EmbeddedEngine, state_dict: dict[str, torch.Tensor]) -> bool:
    served = engine.model.state_dict()
    return all(torch.equal(served[k], v.to(served[k].dtype)) for k, v in state_dict.items())


def _version(url: str) -> str:
    return get(f"{url}/get_model_info", timeout=10).json()["weight_version"]


def _run(servers: list[tuple[str, EmbeddedEngine]], body: Callable[[list[SGLangEngine]], Awaitable[None]]) -> None:
    async def main() -> None:
        clients = [SGLangEngine(url, api_key=KEY, outage_timeout_s=5.0) for url, _ in servers]
        try:
            await body(clients)
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    asyncio.run(main())


def test_publish_twice_then_change_members(servers):
    (url_a, a), (url_b, b) = servers

    async def body(clients: list[SGLangEngine]) -> None:
        publisher = DistributedPublisher(clients, backend="gloo", group_name=GROUP, timeout_s=30)
        await publisher.connect()
        first = _shifted(a, 0.01)
        await publisher.publish(first, 1)
        assert _holds(a, first) and _holds(b, first)
        assert _version(url_a) == _version(url_b) == "1"
        assert clients[0].weight_version == 1

        second = _shifted(a, 0.02, torch.bfloat16)  # the dtype travels: the servers receive bf16 and cast
        await publisher.publish(second, 2)
        assert _holds(a, second) and _holds(b, second)
        assert _version(url_a) == _version(url_b) == "2"

        # a name the model does not have: refused after receiving, naming the server
        refused = rf"weights group '{GROUP}': server at ({url_a}|{url_b}) answered 400 .*not a parameter"
        with pytest.raises(EngineError, match=refused):
            await publisher.publish({"not.a.parameter": torch.ones(3)}, 3)
        with pytest.raises(EngineError, match="out of step"):
            await publisher.publish(second, 3)

        await publisher.close()  # destroys on both servers
        response = post(f"{url_a}/destroy_weights_update_group", json={"group_name": GROUP}, timeout=10)
        assert response.status_code == 400 and repr(GROUP) in response.text

        await publisher.connect([clients[1]])  # only b now, as rank 1 of 2
        third = _shifted(b, 0.03)
        await publisher.publish(third, 3)
        assert _holds(b, third) and not _holds(a, third)
        assert (_version(url_a), _version(url_b)) == ("2", "3")
        generated = post(f"{url_b}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                         timeout=30).json()
        assert generated["meta_info"]["weight_version"] == "3"
        await publisher.close()

    _run(servers, body)


def test_routes_validate_their_bodies(servers):
    (url, _), _ = servers
    update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"}
    outside = post(f"{url}/update_weights_from_distributed", json=update, timeout=10)  # SGLang 0.5.21+'s rule
    assert outside.status_code == 400 and "must run between begin_weight_update()" in outside.json()["message"]
    with weight_session(url):
        response = post(f"{url}/update_weights_from_distributed", json=update, timeout=10)
    assert response.status_code == 400 and "'nope'" in response.json()["error"]["message"]

    cases = [
        ({**update, "dtypes": ["float33"]}, "group_name"),  # the group is looked up first
        ({**update, "shapes": [[2], [3]]}, "names, dtypes, shapes"),
        ({**update, "shapes": [[-1]]}, "shapes"),
        ({**update, "load_format": "flattened_bucket"}, "load_format"),
        ({**update, "names": ["x", "x"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2}, "names"),
    ]
    for body, field in cases:
        with weight_session(url):
            response = post(f"{url}/update_weights_from_distributed", json=body, timeout=10)
        assert response.status_code == 400 and field in response.text, (body, response.text)

    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2}
    response = post(f"{url}/init_weights_update_group", json=init, timeout=10)
    assert response.status_code == 400 and "rank_offset" in response.text
    response = post(f"{url}/init_weights_update_group", json={**init, "rank_offset": 1, "backend": "nccl"}, timeout=10)
    assert response.status_code == 400 and response.json()["success"] is False and "gloo" in response.json()["message"]


def test_a_second_group_of_one_name_is_refused(servers):
    (url, _), (url_b, _) = servers

    async def body(clients: list[SGLangEngine]) -> None:
        publisher = DistributedPublisher(clients[:1], group_name="taken", timeout_s=30)
        await publisher.connect()
        try:
            init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                    "group_name": "taken", "backend": "gloo"}
            response = post(f"{url}/init_weights_update_group", json=init, timeout=10)
            assert response.status_code == 400 and "'taken' exists" in response.json()["message"]
            with weight_session(url_b):
                response = post(f"{url_b}/update_weights_from_distributed", timeout=10,
                                json={"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "taken"})
            assert response.status_code == 400 and "'taken'" in response.text  # b is not in it
        finally:
            await publisher.close()

    _run(servers, body)


def test_a_server_that_cannot_join_is_named(servers):
    gone = f"http://127.0.0.1:{free_port()}"

    async def body(clients: list[SGLangEngine]) -> None:
        missing = SGLangEngine(gone, api_key=KEY, outage_timeout_s=0.5)
        # the live server waits for the missing one until timeout_s: short here, so its thread ends soon
        publisher = DistributedPublisher([clients[0], missing], group_name="half", timeout_s=2)
        try:
            with pytest.raises(EngineError, match=rf"weights group 'half': server at {gone} failed"):
                await publisher.connect()
            assert not publisher.connected
        finally:
            await missing.close()

    _run(servers, body)


def _as_sglang_does(port: int, rank: int, name: str, out: list[torch.Tensor]) -> None:
    """SGLang's (and slime's) `init_custom_process_group` (torch's private helper), then its receive or send."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=30)
    store, _, _ = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", rank, 2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(2, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
                                           group_name=name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    for handle in [torch.distributed.broadcast(t, src=0, group=pg, async_op=True) for t in out]:
        handle.wait()
    torch.distributed.destroy_process_group(pg)


@pytest.mark.parametrize("ours", [0, 1], ids=["trainer-here-server-sglang", "server-here-trainer-slime"])
def test_groups_join_those_sglang_makes(ours):
    """The store layout matches torch's own group helper, so either side can be SGLang / slime."""
    sent = [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.tensor([7.5])]
    name = f"compat-{ours}"
    theirs = [t.clone() for t in sent] if ours == 1 else [torch.empty_like(t) for t in sent]
    if ours == 0:
        store = open_store("127.0.0.1", 0, 0, 2, 30)
        peer = threading.Thread(target=_as_sglang_does, args=(store.port, 1, name, theirs))
        peer.start()
        group = join_group(store, 0, 2, name, "gloo", 30)
        group.send(sent)
        peer.join(30)
        assert all(torch.equal(a, b) for a, b in zip(theirs, sent, strict=True))
    else:
        port = free_port()
        peer = threading.Thread(target=_as_sglang_does, args=(port, 0, name, theirs))
        peer.start()
        group = create_group("127.0.0.1", port, 1, 2, name, "gloo", 30)
        got = group.receive([(t.shape, t.dtype) for t in sent], "cpu")
        peer.join(30)
        assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
    assert not peer.is_alive()
    group.destroy()


@pytest.mark.parametrize("route", ["/init_weights_update_group", "/update_weights_from_distributed",
                                   "/destroy_weights_update_group"])
def test_weight_group_routes_need_the_api_key(servers, route):
    (url, _), _ = servers
    assert httpx.post(f"{url}{route}", json={"group_name": GROUP}, timeout=10).status_code == 401


def test_dtype_names():
    for name, dtype in [("float32", torch.float32), ("torch.float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        assert parse_dtype(name) == dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    for bad in ["float33", "Tensor", " float32", "torch.nn"]:
        with pytest.raises(ValueError, match="not a torch dtype"):
            parse_dtype(bad)


def test_nccl_refusing_two_ranks_on_one_gpu_says_what_to_do_instead(monkeypatch):
    """What NCCL said on an H100 when a trainer and `relax-gym serve` shared the GPU; reproduced with a group whose
    broadcast fails so, since no CPU has NCCL."""
    class OneGpuGroup:
        def send(self, tensors):
            raise RuntimeError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage "
                               "(run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9")

    class Receiving:
        base_url = "http://127.0.0.1:1"

        async def update_weights_from_distributed(self, *args):
            await asyncio.Event().wait()  # receives until the trainer's side fails

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    publisher = DistributedPublisher([Receiving()], backend="nccl")
    publisher._group = OneGpuGroup()
    with pytest.raises(EngineError, match="invalid usage") as caught:
        asyncio.run(publisher.publish({}, 1))
    assert ONE_GPU_EACH in str(caught.value)
