"""The second real family through the gym: Qwen2.5-Coder-0.5B-Instruct (the `qwen_coder` fixture), its own
Qwen2 tokenizer and template, which renders `tools` and teaches `<tool_call>` tags, and the tool calls it writes
by itself, which carry no tags (docs/envs.md: "Models that call tools by themselves")."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from relax_gym.cli import main
from relax_gym.models import load_model
from relax_gym.rollout.preflight import preflight, report_dict
from relax_gym.tools import get_tool_format
from relax_gym.trajectory import read_jsonl

pytestmark = pytest.mark.timeout(900)
WEATHER = "tests/support/weather_env.py:test/Weather-v0"


def test_its_own_template_is_certified_with_tools(qwen_coder):
    loaded = load_model(str(qwen_coder))
    report = report_dict(loaded, preflight(loaded))
    assert report["certified"] and not report["warnings"], report
    assert {"tool calls", "plain multi-turn"} <= {c["case"] for c in report["cases"] if c["match"]}


def test_its_untagged_tool_calls_run_in_a_tool_episode_with_exact_tokens(qwen_coder, tmp_path, capsys):
    """Asked a city's weather (greedy), it writes the call as bare JSON, which `hermes` reads as prose and
    `hermes-loose` runs; every trajectory's tokens are its template's render of the episode, the tool's answer
    masked out. (Given the answer, this model calls the tool again: measured, and why no reward is asserted.)"""
    out = tmp_path / "weather.jsonl"
    assert main(["rollout", "--model", str(qwen_coder), "--env", WEATHER, "--tool-format", "hermes-loose", "-n", "2",
                 "--seed", "0", "--temperature", "0", "--max-new-tokens", "48", "--max-turns", "2",
                 "--max-total-tokens", "1024", "--out", str(out)]) == 0, capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(qwen_coder)
    episodes = list(read_jsonl(out))
    assert len(episodes) == 2
    for t in episodes:
        t.check()
        assert t.metrics["tool_calls"] >= 1 and t.metrics["tool_errors"] == 0, t.metrics
        assert t.metrics["rerender_match"], t.metrics
        prompt = tokenizer.decode(t.token_ids[: t.prompt_len])
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt, prompt
        city = t.infos[0]["city"]
        first = tokenizer.decode(t.token_ids[t.prompt_len :]).split("<|im_end|>")[0]
        assert first.startswith('{"name": "get_weather"') and city in first, first
        assert not get_tool_format("hermes").parse(first).has_tool_calls
        policy = tokenizer.decode([tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m])
        rest = tokenizer.decode(t.token_ids[t.prompt_len :])
        assert f"°C and sunny in {city}" in rest and "<tool_response>" not in policy, rest
