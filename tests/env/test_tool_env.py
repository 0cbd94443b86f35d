import json
import threading
import time

import pytest

from relax_gym import ToolEnv, tool
from relax_gym.env.core import EpisodeOverError
from relax_gym.tools import ToolError


class Lookup(ToolEnv):
    """Find a value with a tool."""

    max_turns = 3

    def new_task(self, rng, options):
        key = ["a", "b", "c"][int(rng.integers(3))]
        return {"prompt": f"What is the value of {key}?", "key": key}

    @tool
    def value(self, key: str) -> int:
        """Looks a value up.

        Args:
            key: a single letter
        """
        if key not in "abc":
            raise ToolError(f"no value for {key!r}; keys are a, b, c")
        return ord(key)

    def grade(self, task, answer):
        return float(answer.strip() == str(ord(task["key"])))


def call(args) -> str:
    return "<tool_call>" + json.dumps({"name": "value", "arguments": args}) + "</tool_call>"


def test_tool_turn_then_answer_counts_and_scores():
    env = Lookup()
    obs, info = env.reset(seed=0)
    assert obs[0]["role"] == "user" and info == {"turn": 0, "tool_calls": 0, "tool_successes": 0, "tool_errors": 0}
    key = env.episode["task"]["key"]
    obs, reward, terminated, truncated, info = env.step(call({"key": key}) + call({"key": "z"}) + "<tool_call>{")
    assert [m["role"] for m in obs] == ["tool", "tool", "tool"]
    texts = [m["content"][0]["text"] for m in obs]
    assert "unclosed" in texts[0]
    assert texts[1] == str(ord(key))
    assert texts[2] == "Error: value: no value for 'z'; keys are a, b, c"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"turn": 1, "tool_calls": 2, "tool_successes": 1, "tool_errors": 2}
    obs, reward, terminated, truncated, info = env.step(str(ord(key)))
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"]["status"] == "ok"
    with pytest.raises(EpisodeOverError):
        env.step("again")


def test_turn_limit_truncates():
    env = Lookup(max_turns=2)
    env.reset(seed=1)
    assert env.step(call({"key": "a"}))[3] is False
    _, reward, terminated, truncated, info = env.step(call({"key": "a"}))
    assert (reward, terminated, truncated, info["truncated_by"]) == (0.0, False, True, "max_turns")


def test_state_round_trip_resumes_the_episode():
    env = Lookup()
    env.reset(seed=2)
    env.step(call({"key": "b"}))
    snapshot = env.get_state()
    expected = env.step(call({"key": "c"}))
    other = Lookup()
    other.set_state(snapshot)
    assert other.step(call({"key": "c"})) == expected


def test_step_before_reset_is_a_clear_error():
    with pytest.raises(EpisodeOverError, match="reset"):
        Lookup().step("hi")


def test_tools_are_offered_with_schemas():
    env = Lookup()
    assert env.metadata["tools"] == ("value",)
    assert env.tool_schemas[0]["function"]["parameters"]["properties"]["key"]["type"] == "string"
    with pytest.raises(ValueError):
        Lookup(max_turns=0)


def test_blocking_envs_step_in_a_thread_and_fast_ones_on_the_loop():
    import asyncio
    import threading

    from relax_gym.envs.procedural import GuessNumberEnv

    class Where(GuessNumberEnv):
        def step(self, action):
            self.thread = threading.current_thread()
            return super().step(action)

    class SlowWhere(Where):
        blocking = True

    for cls, on_loop in ((Where, True), (SlowWhere, False)):
        env = cls()

        async def run(env=env):
            await env.areset(seed=0)
            await env.astep("5")

        asyncio.run(run())
        assert (env.thread is threading.main_thread()) == on_loop


# --- bounded steps: the per-turn cap, the step budget, concurrency -------------------------------


class Tools(ToolEnv):
    """Tools that sleep, block, meet at a barrier or exit, to exercise how a turn's calls run."""

    max_turns = 5

    def __init__(self, parties: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.barrier = threading.Barrier(parties, timeout=20)
        self.ran: list[str] = []
        self.running = threading.Lock()

    def new_task(self, rng, options):
        return {"prompt": "Use the tools."}

    def grade(self, task, answer):
        return 0.0

    @tool(concurrent=True)
    def meet(self, i: int) -> str:
        """Waits until every party has arrived: only calls that run at the same time can all get past.

        Args:
            i: an id echoed back
        """
        self.barrier.wait()
        return f"met {i}"

    @tool(concurrent=True)
    def block(self) -> str:
        """Waits for the test to release it."""
        self.release.wait()
        return "released"

    @tool
    def ordered(self, i: int) -> str:
        """An order-dependent tool: records that it ran, and that no other call of its kind overlapped.

        Args:
            i: an id recorded and echoed back
        """
        if not self.running.acquire(blocking=False):
            raise RuntimeError("two order-dependent calls overlapped")
        try:
            time.sleep(0.05)
            self.ran.append(f"ordered {i}")
            return f"ordered {i}"
        finally:
            self.running.release()

    @tool
    def hang(self) -> str:
        """An order-dependent tool that waits for the test to release it."""
        self.release.wait()
        self.ran.append("hang")
        return "released"

    @tool(concurrent=True)
    def leave(self) -> str:
        """Calls sys.exit, which is no Exception."""
        raise SystemExit(3)


def calls(*pairs) -> str:
    return "".join(
        "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>" for name, args in pairs
    )


def texts(observation) -> list[str]:
    return [m["content"][0]["text"] for m in observation]


@pytest.fixture
def tools():
    made: list[Tools] = []

    def make(**kwargs) -> Tools:
        made.append(Tools(**kwargs))
        made[-1].reset(seed=0)
        return made[-1]

    yield make
    for env in made:  # let blocked tool threads finish
        env.release.set()
        env.barrier.abort()


def test_calls_past_the_per_turn_cap_are_not_run_and_the_model_is_told():
    env = Lookup()
    assert env.max_tool_calls_per_turn == 4
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(call({"key": "a"}) * 10)
    limit = "Error: 6 more tool call(s) were not run: at most 4 tool calls are run per turn."
    assert texts(obs) == ["97"] * 4 + [limit]
    assert [m["name"] for m in obs] == ["value"] * 4 + ["tool_call_limit"]
    assert info == {"turn": 1, "tool_calls": 4, "tool_successes": 4, "tool_errors": 6}
    assert not (terminated or truncated)
    two = Lookup(max_tool_calls_per_turn=2)
    two.reset(seed=0)
    *_, info = two.step(call({"key": "a"}) * 3)
    assert (info["tool_calls"], info["tool_errors"]) == (2, 1)


@pytest.mark.parametrize(
    "kwargs", [{"max_tool_calls_per_turn": 0}, {"max_tool_calls_per_turn": 1.5}, {"max_tool_calls_per_turn": True},
               {"step_timeout_s": 0}, {"step_timeout_s": -1.0}, {"step_timeout_s": float("nan")},
               {"step_timeout_s": float("inf")}],
)  # fmt: skip
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Lookup(**kwargs)


def test_a_call_past_the_step_budget_becomes_a_timeout_error(tools):
    env = tools(step_timeout_s=1.0)
    obs, _, terminated, truncated, info = env.step(calls(("block", {}), ("ordered", {"i": 1})))
    assert texts(obs) == ["Error: block: tool call timed out after the step budget of 1 s", "ordered 1"]
    assert info == {"turn": 1, "tool_calls": 2, "tool_successes": 1, "tool_errors": 1}
    assert not (terminated or truncated)
    env.release.set()  # the abandoned call finishing later changes nothing already reported
    obs, *_, info = env.step(calls(("block", {})))
    assert texts(obs) == ["released"] and info["tool_successes"] == 2


def test_order_dependent_calls_stop_at_the_budget_in_order(tools):
    env = tools(step_timeout_s=1.0)
    obs, *_, info = env.step(calls(("ordered", {"i": 1}), ("hang", {}), ("ordered", {"i": 2})))
    assert texts(obs) == [
        "ordered 1",
        "Error: hang: tool call timed out after the step budget of 1 s",
        "Error: ordered: tool call timed out after the step budget of 1 s",
    ]
    assert info["tool_errors"] == 2
    env.release.set()
    obs, *_ = env.step(calls(("ordered", {"i": 3})))
    assert texts(obs) == ["ordered 3"]
    assert env.ran[0] == "ordered 1" and "ordered 2" not in env.ran  # the call after the hung one never started


def test_concurrent_calls_run_together_and_results_keep_call_order(tools):
    env = tools(parties=3, max_tool_calls_per_turn=6)
    action = calls(("ordered", {"i": 1}), ("meet", {"i": 0}), ("ordered", {"i": 2}), ("meet", {"i": 1}),
                   ("meet", {"i": 2}))  # fmt: skip
    obs, *_, info = env.step(action)
    # Three calls at one barrier only all pass when they run at the same time; one after another, the first waits
    # for the others until the barrier breaks and every meet call fails.
    assert texts(obs) == ["ordered 1", "met 0", "ordered 2", "met 1", "met 2"]
    assert info == {"turn": 1, "tool_calls": 5, "tool_successes": 5, "tool_errors": 0}
    assert env.ran == ["ordered 1", "ordered 2"]


def test_a_tool_calling_sys_exit_is_an_error_observation(tools):
    env = tools()
    obs, *_, info = env.step(calls(("leave", {}), ("ordered", {"i": 1})))
    assert texts(obs) == ["Error: leave failed: SystemExit", "ordered 1"]
    assert (info["tool_errors"], info["tool_successes"]) == (1, 1)


def test_tool_marks():
    env = Tools()
    assert {name: t.concurrent for name, t in env.toolset.tools.items()} == {
        "block": True, "hang": False, "leave": True, "meet": True, "ordered": False,
    }  # fmt: skip
    assert Lookup().toolset.tools["value"].concurrent is False


class RowTools(Lookup):
    """Each task brings a tool of its own (as NeMo Gym and verifiers rows do), beside the class's `value`."""

    def new_task(self, rng, options):
        return {**super().new_task(rng, options), "unit": ["cm", "kg", "s"][int(rng.integers(3))]}

    def task_tools(self, task):
        from relax_gym.tools import SchemaTool

        schema = {"type": "function", "name": f"in_{task['unit']}", "description": "Converts a value.",
                  "parameters": {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0}},
                                 "required": ["value"], "additionalProperties": False}}
        return [SchemaTool(schema, lambda arguments: f"{arguments['value']} {task['unit']}")]


def test_a_tasks_own_tools_are_offered_and_run_for_its_episode_only():
    env = RowTools()
    env.reset(seed=0)
    unit = env.task["unit"]
    names = [s["function"]["name"] for s in env.tool_schemas]
    assert names == ["value", f"in_{unit}"]  # the class's tools, then the task's
    converted = "<tool_call>" + json.dumps({"name": f"in_{unit}", "arguments": {"value": 3}}) + "</tool_call>"
    obs = env.step(converted)[0]
    assert obs[0]["content"][0]["text"] == f"3 {unit}"
    bad = converted.replace('"value": 3', '"value": -1')
    assert "invalid arguments: value: -1 is less than the minimum of 0" in env.step(bad)[0][0]["content"][0]["text"]
    other = next(seed for seed in range(1, 50) if _unit(seed) != unit)
    env.reset(seed=other)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["value", f"in_{_unit(other)}"]


def _unit(seed: int) -> str:
    env = RowTools()
    env.reset(seed=seed)
    return env.task["unit"]


def test_a_restored_snapshot_offers_its_tasks_tools():
    env, other = RowTools(), RowTools()
    env.reset(seed=0)
    other.reset(seed=next(s for s in range(1, 50) if _unit(s) != env.task["unit"]))
    other.set_state(env.get_state())
    assert other.tool_schemas == env.tool_schemas
