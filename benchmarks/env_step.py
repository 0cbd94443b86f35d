"""Scripted-episode steps per second for every bundled env, and sandbox latency.

Each env plays scripted episodes (a tool call where the env has tools, then an
answer), timing `reset` + `step`. The baseline, measured in the same run, is a
trivial echo env: the ratio env/echo says how much slower than the bare
relax_gym/gymnasium step path each env is, which stays meaningful on a shared,
noisy machine where absolute numbers drift.

    python benchmarks/env_step.py [EPISODES]     # prints a markdown table
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import relax_gym
from relax_gym.env.conformance import scripted_actions
from relax_gym.messages import user

#: The bundled ids timed here. Each plays its `scripted_actions()` hook, as the conformance checker does.
ENV_IDS = ["relax/Math-v0", "relax/MathTool-v0", "relax/DeepEyes-v0", "relax/AudioQA-v0", "relax/Arithmetic-v0",
           "relax/Countdown-v0", "relax/GuessNumber-v0", "relax/ReasoningGym-v0"]


class Echo(relax_gym.Env):
    """The baseline: returns the action as the next user message."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [user("say something")], {}

    def step(self, action):
        return [user(action)], 0.0, False, False, {}


def steps_per_second(make: Callable[[], relax_gym.Env], episodes: int, script: list[str] | None = None) -> float:
    """`script` plays each episode; by default the env's `scripted_actions()` (fixed per env, so read once)."""
    env = make()
    if script is None:
        env.reset(seed=0)
        script = scripted_actions(env)
    steps = 0
    start = time.perf_counter()
    for episode in range(episodes):
        obs, _ = env.reset(seed=episode)
        env.format_observation(obs)
        for action in script:
            obs, _, terminated, truncated, _ = env.step(action)
            env.format_observation(obs)
            steps += 1
            if terminated or truncated:
                break
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed


def measure(episodes: int = 50) -> dict:
    baseline = steps_per_second(Echo, episodes * 4, ["hello"] * 4)
    rows = {}
    for env_id in ENV_IDS:
        try:
            rate = steps_per_second(lambda env_id=env_id: relax_gym.make(env_id), episodes)
        except ImportError as err:  # an optional extra that is not installed
            rows[env_id] = {"skipped": str(err).splitlines()[0]}
            continue
        rows[env_id] = {"steps_per_s": rate, "ratio_to_echo": rate / baseline}
    return {"episodes": episodes, "echo_steps_per_s": baseline, "envs": rows}


def markdown(result: dict, sandbox: dict | None) -> str:
    lines = [f"Scripted episodes ({result['episodes']} per env); baseline echo env: "
             f"{result['echo_steps_per_s']:.0f} steps/s in the same run.", "",
             "| env | steps/s | ratio to echo |", "|---|---:|---:|"]
    for env_id, row in result["envs"].items():
        if "skipped" in row:
            lines.append(f"| {env_id} | skipped: {row['skipped']} | |")
        else:
            lines.append(f"| {env_id} | {row['steps_per_s']:.1f} | {row['ratio_to_echo']:.4f} |")
    if sandbox:
        from sandbox_latency import markdown as sandbox_markdown

        lines += ["", sandbox_markdown(sandbox)]
    return "\n".join(lines)


if __name__ == "__main__":
    episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    result = measure(episodes)
    sandbox = None
    try:
        from sandbox_latency import measure as sandbox_measure

        sandbox = sandbox_measure(20)
    except Exception as err:  # no engine here: report it rather than hide the env numbers
        print(f"sandbox latency not measured: {err}", file=sys.stderr)
    print(markdown(result, sandbox))
    print(json.dumps(result), file=sys.stderr)
