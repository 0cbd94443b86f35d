"""relax-gym against TRL's GRPOTrainer: seconds per step and wall time to the same reward, side by side.

Two settings (`--setting`), each the same on both sides:

- `quickstart` (the default): the quickstart's setting from its warm-start checkpoint
  (`examples/checkpoints/tiny-arithmetic`): `relax/Arithmetic-v0` with digits=1, n_terms=2, ops="+",
  16 prompts x 8 samples per step, temperature 0.5, lr 3e-4, at most 4 new tokens.
- `smollm2`: `examples/configs/smollm2_arithmetic.yaml`'s setting, read from that file: the real pretrained
  SmolLM2-135M-Instruct (its fp32 folder, made by `scripts/make_smollm2.py`) on `relax/Arithmetic-v0` with
  digits=2, n_terms=2, ops="+", 4 prompts x 4 samples per step, temperature 0.7, lr 5e-6, at most 24 new tokens.
  At the end each side's final model, and the base model, play the same held-out tasks (below).

Both: AdamW (constant lr, no weight decay, grad clip 1.0), GRPO with group-std scaling, token-mean loss (TRL's
`dapo`), clip 0.2 (relax-gym's grpo default is 0.2 low / 0.28 high; run sync with one update per batch the ratio is 1 up
to numerics, so neither binds), no KL, one update per batch, one turn. relax-gym trains from the setting's config file
with the benchmark's overrides (no eval during training, no checkpoint but the final one). TRL's reward function is
relax-gym's grader: each prompt row carries the seed it was drawn with, and the reward is `env.reset(seed=seed)` then
`env.step(completion).reward`; a completion cut off at the token limit (no end-of-turn token) gets 0, as relax-gym
leaves such an episode ungraded. Both sides render the env's messages with the model's own chat template (TRL's
conversational prompts go through `tokenizer.apply_chat_template`, relax-gym's through the same).

Per seed, by default (`--cores-each 1`) the two runs go at the same time, each in its own process pinned
to its own core (`os.sched_setaffinity`, one torch thread, OMP/MKL threads 1), so machine noise hits both.
relax-gym runs in sync mode (max_staleness 0, no logprob recompute); TRL runs with HF `generate` (its
default, no vLLM on a CPU). With `--cores-each 2` each side gets both cores (and 2 torch threads) in turn:
relax-gym alone, then TRL alone, since the machine has only two cores; relax-gym then runs async with
max_staleness 1 in both settings, as their config files do, so its rollout and training overlap on
the two cores (quickstart: the engine's thread on one core, the trainer's own process on the other; smollm2: the
config's layout, both roles on both cores), and a sync run on the same placement follows it, for async's efficiency
and the reward async must match.
With `--cli` relax-gym goes through `relax-gym train`'s entry point with the config file's own checkpoints and
evals (every 100 steps for the quickstart) instead of the in-process `Trainer` with both off: the path users run.
Before each run of `--cores-each 2` the kernel's page cache is dropped where the benchmark may (root), since a
full one slowed the later runs.
Reported per framework and seed: mean s/step after the first few steps (the wall clock between consecutive
steps), the training wall time (first step's start to last step's end), wall time from the start to a rolling
(10-step window) train reward of 0.3 and 0.4, the ratios relax-gym / TRL, and relax-gym's phase split from its
metrics rows.

Held-out eval (`--eval-tasks N`, default 64 for smollm2, 0 = off for quickstart): after training, relax-gym's run
folder (its final checkpoint) and TRL's `save_model` folder (weights and tokenizer), and once the base model, each go
through the same command in relax-gym's venv, greedy:

    relax-gym eval --model FOLDER --env relax/Arithmetic-v0 --env-arg digits=2 --env-arg n_terms=2 --env-arg ops=+ \
      -n 64 --max-new-tokens 24 --max-turns 1 --max-total-tokens 192 --json --out ...

and the summary gives held-out pass@1 base -> after for each framework.

Phase floors (quickstart only: on SmolLM2 they take minutes, and benchmarks/real_model.py holds relax-gym's
engine and trainer to plain HF there), measured at the end of the relax-gym worker (same process, same cores, after
training), say how far each relax-gym phase is from what plain HF code needs for the same work: the rollout floor
is one batched `model.generate` of a step's prompts (median of 5), the trainer floor the plain model's forward +
backward + AdamW step on a step's sequences (prompts plus completions of the run's mean completion length,
right-padded; median of 10). `wait_rollout_s` is printed against the rollout floor, `train_s` against the trainer
floor, in seconds and as a multiple of the floor. In async mode `wait_rollout_s` is only the part of the rollout the
trainer waited for, so it can fall below its floor.

TRL lives in its own venv, never in the project's (it could move pinned packages); see
benchmarks/requirements-trl.txt:

    python3.11 -m venv /tmp/venv-trl
    /tmp/venv-trl/bin/pip install torch==2.13.0
    /tmp/venv-trl/bin/pip install -r benchmarks/requirements-trl.txt
    /tmp/venv-trl/bin/pip install -e .

Rerun:

    .venv/bin/python benchmarks/vs_trl.py --quick                     # 8 steps, 1 seed: does it work
    .venv/bin/python benchmarks/vs_trl.py --seeds 0 1 --steps 200     # the measurement, one core each
    .venv/bin/python benchmarks/vs_trl.py --seeds 0 1 --steps 200 --cores-each 2   # both cores, in turn
    .venv/bin/python benchmarks/vs_trl.py --setting smollm2 --seeds 0 --steps 20 --cores-each 2   # SmolLM2
    .venv/bin/python benchmarks/vs_trl.py --setting smollm2 --quick --eval-tasks 4   # does it work
    .venv/bin/python benchmarks/vs_trl.py --seeds 0 --steps 400 --cli   # relax-gym through `relax-gym train`
    .venv/bin/python benchmarks/vs_trl.py --relax-overrides rollout.max_total_tokens=96 ...  # extra config
    .venv/bin/python benchmarks/vs_trl.py --trl-python /path/to/venv/bin/python ...

Files go to benchmarks/runs/vs_trl/<setting>/: per-step rows to <framework>_seed<N>.jsonl, relax-gym's floors to
relax_seed<N>.floors.json, the run folders to <framework>_seed<N>_run/, the held-out trajectories to
<name>.eval.jsonl, the summary to summary.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean, median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).resolve().parent / "runs" / "vs_trl"  # a folder per setting under it
CONFIGS = ROOT / "examples" / "configs"
WINDOW = 10
THRESHOLDS = (0.3, 0.4)
SKIP_STEPS = 3  # steps left out of the s/step mean (warm-up)
PHASES = ("wait_rollout_s", "logprobs_s", "train_s", "weight_sync_s")
FLOOR_OF = {"wait_rollout_s": "rollout_floor_s", "train_s": "trainer_floor_s"}  # phase -> the floor it is held to


@dataclass(frozen=True)
class Setting:
    """What both sides train: relax-gym's config file, and the values that override it there and that TRL's side,
    the floors and the held-out eval take."""

    name: str
    config: Path  # relax-gym's config file (its other values, e.g. micro_batch_tokens, are relax-gym's alone)
    model: Path
    env_id: str
    env_kwargs: dict[str, Any]
    group_size: int
    groups_per_step: int
    temperature: float
    lr: float
    max_new_tokens: int
    max_total_tokens: int
    eval_tasks: int  # held-out tasks at the end by default (0: no eval)
    #: with --cores-each 2 (relax-gym async, max_staleness 1): the engine's thread pinned to one core and the
    #: trainer in a process of its own on the other (the tiny model, whose steps are Python-bound); else the
    #: config's layout, both roles on both cores
    pin_roles: bool
    floors: bool  # measure the phase floors after relax-gym's run

    @classmethod
    def from_config(cls, name: str, config: Path, eval_tasks: int, pin_roles: bool, floors: bool) -> Setting:
        """The setting a one-env relax-gym config file trains, read from the file."""
        import yaml

        cfg = yaml.safe_load(config.read_text())
        (env,), rollout = cfg["envs"], cfg["rollout"]
        return cls(name, config, Path(cfg["model"]).expanduser(), env["id"], env.get("kwargs", {}),
                   rollout["group_size"], rollout["groups_per_step"], float(rollout["temperature"]),
                   float(cfg["trainer"]["lr"]), rollout["max_new_tokens"], rollout["max_total_tokens"], eval_tasks,
                   pin_roles, floors)


SETTINGS = {s.name: s for s in (
    Setting("quickstart", CONFIGS / "quickstart.yaml", ROOT / "examples" / "checkpoints" / "tiny-arithmetic",
            "relax/Arithmetic-v0", {"digits": 1, "n_terms": 2, "ops": "+"}, group_size=8, groups_per_step=16,
            temperature=0.5, lr=3e-4, max_new_tokens=4, max_total_tokens=128, eval_tasks=0,
            pin_roles=True, floors=True),
    # no floors: on SmolLM2 they take minutes, and benchmarks/real_model.py holds its engine and trainer to plain HF
    Setting.from_config("smollm2", CONFIGS / "smollm2_arithmetic.yaml", eval_tasks=64, pin_roles=False,
                        floors=False),
)}


def pin(cores: set[int], threads: int) -> None:
    """Pins this process (and the threads and children it starts later) to `cores`, with `threads` torch threads."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set once some parallel work ran
        torch.set_num_interop_threads(threads)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_dir_of(rows: Path) -> Path:
    """A worker's run folder, beside its rows: relax-gym's run_dir, TRL's output_dir (its final model too)."""
    return rows.parent / f"{rows.stem}_run"


# --- relax-gym side -------------------------------------------------------------------------------


def run_relax(
    setting: Setting, seed: int, steps: int, out: Path, mode: str = "sync", overrides: tuple[str, ...] = (),
    cli: bool = False,
) -> None:
    """relax-gym's in-process trainer (sync, or async with staleness 1); rows are its metrics rows, timed by their
    wall clock. Its final checkpoint stays in its run folder (for the held-out eval). Ends with the phase floors
    (`measure_floors`, if the setting has them), written next to the rows. `cli`: through `relax-gym train`'s own
    entry point instead, with the config file's checkpoints and evals, as users run it."""
    import asyncio

    from relax_gym.cli import main as relax_gym_main
    from relax_gym.trainer.config import load_config
    from relax_gym.trainer.loop import Trainer

    s = setting
    run_dir = run_dir_of(out)
    if run_dir.exists():  # else the run would resume from its checkpoint
        import shutil

        shutil.rmtree(run_dir)
    kwargs = ", ".join(f"{k}: {v!r}" for k, v in s.env_kwargs.items())
    # the setting's own values are no-ops on a config file they were read from; eval_every=0: no eval during the
    # run (not even at its start); checkpoint_every: only the final checkpoint (both left to the file with `cli`)
    given = [
        f"run_dir={run_dir}", f"model={s.model}", f"seed={seed}",
        f"envs=[{{id: {s.env_id}, kwargs: {{{kwargs}}}}}]",
        f"rollout.group_size={s.group_size}", f"rollout.groups_per_step={s.groups_per_step}",
        f"rollout.temperature={s.temperature}", f"rollout.max_new_tokens={s.max_new_tokens}", "rollout.max_turns=1",
        f"rollout.max_total_tokens={s.max_total_tokens}",
        f"trainer.lr={s.lr}", f"trainer.mode={mode}", f"trainer.max_staleness={0 if mode == 'sync' else 1}",
        f"trainer.total_steps={steps}", *(() if cli else ("trainer.eval_every=0", "trainer.checkpoint_every=1000000")),
        "algorithm.recompute_old_logprobs=false", *overrides,
    ]
    if cli:
        if relax_gym_main(["train", str(s.config), *given]) != 0:
            sys.exit("relax-gym train failed")
    else:
        trainer = Trainer(load_config(s.config, given))
        asyncio.run(trainer.run())
        del trainer
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("type") == "train"]
    rows, last = [], 0.0
    for r in train:  # time_s is the run's wall clock at each train row: right whether or not steps overlap
        rows.append({"step": r["step"], "reward": r["reward_mean"], "step_s": round(r["time_s"] - last, 3),
                     "t": r["time_s"], "truncated": r["status"].get("truncated", 0) / max(r["episodes"], 1),
                     **{k: r.get(k) for k in PHASES}})
        last = r["time_s"]
    write_rows(out, rows)
    if not s.floors:
        return
    gen = [r["trained_generated_tokens_mean"] for r in train if r.get("trained_generated_tokens_mean") is not None]
    floors = measure_floors(s, seed, fmean(gen) if gen else float(s.max_new_tokens))
    out.with_suffix(".floors.json").write_text(json.dumps(floors, indent=1))


def measure_floors(setting: Setting, seed: int, completion_tokens: float) -> dict[str, Any]:
    """What plain HF code needs for one step's work on this process's cores: the floor each relax-gym phase is
    held to. The batch is a step's (the setting's prompts x samples), rendered with the checkpoint's chat template;
    the trainer floor's completions are random tokens, `completion_tokens` long on average (the run's mean)."""
    import gc

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import relax_gym

    gc.collect()
    tokenizer = AutoTokenizer.from_pretrained(setting.model)
    env = relax_gym.make(setting.env_id, **setting.env_kwargs)
    task_seeds = np.random.default_rng(seed).integers(0, 2**31 - 1, size=setting.groups_per_step).tolist()
    prompts: list[list[int]] = []
    for task_seed in task_seeds:
        messages = [{"role": m["role"], "content": text_of(m)} for m in env.reset(seed=task_seed)[0]]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
        prompts += [ids] * setting.group_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = len(prompts)

    def timed(fn: Any, warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    # rollout floor: one batched generate of the step's prompts, left-padded
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(setting.model).eval()
    gen_cfg = GenerationConfig.from_pretrained(setting.model)
    eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else tokenizer.eos_token_id
    new_tokens: list[int] = []

    def generate() -> None:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                                 temperature=setting.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=setting.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        new_tokens.append(out.shape[1] - width)

    rollout = timed(generate, 1, 5)

    # trainer floor: forward + backward of the completion tokens' logprobs, plus one AdamW step, right-padded
    torch.manual_seed(seed)
    base, extra = int(completion_tokens), round((completion_tokens - int(completion_tokens)) * n)
    lengths = [max(1, base + (i < extra)) for i in range(n)]  # lengths whose mean is the run's
    vocab = len(tokenizer)
    seqs = [p + torch.randint(0, vocab, (k,)).tolist() for p, k in zip(prompts, lengths, strict=True)]
    width = max(map(len, seqs))
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    completion = torch.zeros(n, width, dtype=torch.bool)  # marks the completion tokens, as loss targets
    for i, (p, k) in enumerate(zip(prompts, lengths, strict=True)):
        completion[i, len(p): len(p) + k] = True
    model = AutoModelForCausalLM.from_pretrained(setting.model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.lr, weight_decay=0.0)

    def train_step() -> None:
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        logprobs = logits.float().log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        logprobs[completion[:, 1:]].sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    trainer = timed(train_step, 2, 10)
    return {
        "rollout_floor_s": median(rollout), "trainer_floor_s": median(trainer),
        "rollout_samples_s": rollout, "trainer_samples_s": trainer, "rollout_new_tokens": new_tokens,
        "batch": [n, width], "prompt_tokens_mean": fmean(map(len, prompts)), "completion_tokens_mean":
        fmean(lengths), "cores": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
    }


# --- TRL side -------------------------------------------------------------------------------------


def run_trl(setting: Setting, seed: int, steps: int, out: Path, gradient_checkpointing: bool = False) -> None:
    """TRL's GRPOTrainer on the same prompts, grader and hyperparameters; rows are timed by a callback. The final
    model (weights and tokenizer) is saved to its run folder (for the held-out eval)."""
    import numpy as np
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import relax_gym

    s = setting
    env = relax_gym.make(s.env_id, **s.env_kwargs)
    n_prompts = steps * s.groups_per_step + s.groups_per_step
    # the held-out tasks are seeds 10**9 + i, i < n (relax_gym.rollout.evaluation): a draw is one with odds n / 2**31
    task_seeds = np.random.default_rng(seed).integers(0, 2**31 - 1, size=n_prompts).tolist()
    prompts = [env.reset(seed=task_seed)[0] for task_seed in task_seeds]
    # conversational prompts: TRL renders them with the tokenizer's own chat template (`apply_chat_template`, as
    # relax-gym does), which for SmolLM2 adds its default system message as on relax-gym's side
    dataset = Dataset.from_dict({
        "prompt": [[{"role": m["role"], "content": text_of(m)} for m in p] for p in prompts],
        "task_seed": task_seeds,
    })
    calls: list[tuple[float, float]] = []  # per reward call (one a step): mean reward, fraction cut off

    def reward(completions: list[Any], completion_ids: list[list[int]], task_seed: list[int],
               **_: Any) -> list[float]:
        scores, cut = [], 0
        for completion, ids, task in zip(completions, completion_ids, task_seed, strict=True):
            if not ids or ids[-1] not in trainer.eos_token_ids:
                cut += 1  # cut off at max_completion_length: relax-gym does not grade such an episode (reward 0)
                scores.append(0.0)
                continue
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            env.reset(seed=int(task))
            scores.append(float(env.step(text)[1]))  # (obs, reward, terminated, truncated, info)
        calls.append((fmean(scores), cut / len(scores)))
        return scores

    rows: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        start = last = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.start:
                self.start = self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            rows.append({"step": state.global_step, "reward": calls[-1][0], "step_s": now - self.last,
                         "t": now - self.start, "truncated": calls[-1][1]})
            self.last = now

    config = GRPOConfig(
        output_dir=str(run_dir_of(out)), seed=seed, use_cpu=True, bf16=False, fp16=False,
        max_steps=steps, learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        per_device_train_batch_size=s.group_size * s.groups_per_step, gradient_accumulation_steps=1,
        num_generations=s.group_size, steps_per_generation=1, num_iterations=1,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=1.0, top_k=0, beta=0.0,
        epsilon=0.2, loss_type="dapo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, shuffle_dataset=True,
        # TRL turns it on by default; relax-gym does not checkpoint, and at these model sizes it only costs time
        gradient_checkpointing=gradient_checkpointing,
    )
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(s.model)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    write_rows(out, rows)
    trainer.save_model(config.output_dir)  # the weights, config, generation config and tokenizer (processing_class)


def text_of(msg: Any) -> str:
    """A relax-gym message's text (its content is a string or a list of text parts)."""
    content = msg["content"]
    if isinstance(content, str):
        return content
    return "".join(p["text"] if isinstance(p, dict) else str(p) for p in content)


# --- held-out eval --------------------------------------------------------------------------------


def held_out(python: str, model: Path, setting: Setting, n: int, out: Path) -> dict[str, Any]:
    """`relax-gym eval` (from `python`'s venv) of `model`, an HF folder or a relax-gym run folder (its latest
    checkpoint), on `n` held-out tasks, greedy, within the setting's token limits: its --json row, with the
    command. The trajectories go to `out`, the command's stderr beside it (.log)."""
    cmd = [str(Path(python).parent / "relax-gym"), "eval", "--model", str(model), "--env", setting.env_id,
           *(a for k, v in setting.env_kwargs.items() for a in ("--env-arg", f"{k}={v}")), "-n", str(n),
           "--max-new-tokens", str(setting.max_new_tokens), "--max-turns", "1",
           "--max-total-tokens", str(setting.max_total_tokens), "--json", "--out", str(out)]
    log = out.with_suffix(".log")
    with log.open("w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        sys.exit(f"held-out eval failed (exit {done.returncode}), see {log}: {' '.join(cmd)}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "command": cmd}


# --- the comparison -------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steady = rows[SKIP_STEPS:] or rows
    rolling = [fmean(r["reward"] for r in rows[max(0, i + 1 - WINDOW): i + 1]) for i in range(len(rows))]
    out: dict[str, Any] = {
        "steps": len(rows),
        "s_per_step": fmean(r["step_s"] for r in steady),
        "wall_s": rows[-1]["t"] if rows else float("nan"),
        "final_rolling_reward": rolling[-1] if rolling else float("nan"),
        "truncated": fmean(r["truncated"] for r in rows) if rows else float("nan"),
    }
    for th in THRESHOLDS:
        hit = next((i for i, v in enumerate(rolling) if i + 1 >= WINDOW and v >= th), None)
        out[f"t_to_{th}"] = rows[hit]["t"] if hit is not None else None
        out[f"step_to_{th}"] = rows[hit]["step"] if hit is not None else None
    if rows and "wait_rollout_s" in rows[0]:
        out["phases"] = {k: fmean(r[k] or 0.0 for r in steady) for k in PHASES}
    return out


def launch(
    python: str, framework: str, setting: Setting, seed: int, steps: int, cores: list[int], out_dir: Path,
    extra: tuple[str, ...] = (), name: str | None = None,
) -> tuple[subprocess.Popen, Path]:
    """A worker process pinned to `cores`, one torch / OMP / MKL thread per core; its files, in `out_dir`, are
    named `name` (default: the framework)."""
    name = name or framework
    path = out_dir / f"{name}_seed{seed}.jsonl"
    path.unlink(missing_ok=True)
    path.with_suffix(".floors.json").unlink(missing_ok=True)
    threads = str(len(cores))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONHASHSEED": str(seed)}
    log = open(path.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    cmd = [python, str(Path(__file__).resolve()), "--worker", framework, "--setting", setting.name, "--seed",
           str(seed), "--steps", str(steps), "--pin", *map(str, cores), "--out", str(path), *extra]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), path


def drop_page_cache() -> bool:
    """Empties the kernel's page cache (root only; False where it cannot), so each run starts from the same memory
    state: on this VM, with 15 GB of page cache left by the runs before (their checkpoints), TRL's SmolLM2 step
    took 12.3 s against 9.9 s after dropping it, and the side that runs last would pay for the others' files."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def wait_all(procs: dict[str, tuple[subprocess.Popen, Path]], seed: int) -> dict[str, float]:
    """Each process's wall time, start-up included (polled, so one side's time is not the slower side's)."""
    start = time.perf_counter()
    ended: dict[str, float] = {}
    while len(ended) < len(procs):
        for name, (proc, path) in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.perf_counter() - start
                if proc.returncode != 0:
                    sys.exit(f"{name} seed {seed} failed (exit {proc.returncode}); see {path.with_suffix('.log')}")
        time.sleep(0.05)
    return ended


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="quickstart",
                        help="quickstart: the tiny warm-start checkpoint on 1-digit sums (default); smollm2: "
                             "examples/configs/smollm2_arithmetic.yaml, SmolLM2-135M-Instruct on 2-digit sums")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="8 steps, seed 0: checks that both sides run")
    parser.add_argument("--eval-tasks", type=int, metavar="N",
                        help="held-out tasks that each side's final model and the base model play at the end "
                             "(relax-gym eval, greedy); default: 64 for smollm2, 0 (none) for quickstart")
    parser.add_argument("--trl-python", default="/tmp/venv-trl/bin/python")
    parser.add_argument("--relax-python", default=sys.executable)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1],
                        help="relax-gym's core, then TRL's (with --cores-each 2: the two cores each side gets)")
    parser.add_argument("--cores-each", type=int, choices=[1, 2], default=1,
                        help="1: both sides at once, one core each (relax-gym sync); 2: each side alone on both "
                             "cores, one after the other (relax-gym async, max_staleness 1)")
    parser.add_argument("--cli", action="store_true",
                        help="relax-gym through `relax-gym train` as users run it, the config file's checkpoints and "
                             "evals on (default: the in-process Trainer, no evals, only the final checkpoint)")
    parser.add_argument("--relax-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra relax-gym config overrides, applied after the benchmark's own")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="keep TRL's default gradient checkpointing (off here: relax-gym does not checkpoint)")
    parser.add_argument("--worker", choices=["relax", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pin", type=int, nargs="+", default=[0], help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    setting = SETTINGS[args.setting]

    if args.worker:
        pin(set(args.pin), len(args.pin))
        if args.worker == "relax":
            run_relax(setting, args.seed, args.steps, args.out, args.mode, tuple(args.relax_overrides), args.cli)
        else:
            run_trl(setting, args.seed, args.steps, args.out, args.trl_gradient_checkpointing)
        return

    if not setting.model.is_dir():
        sys.exit(f"{setting.model}: no such model folder" +
                 (" (make it with `python scripts/make_smollm2.py`)" if setting.name == "smollm2" else ""))
    out_dir = RUNS / setting.name
    seeds, steps = ([0], 8) if args.quick else (args.seeds, args.steps)
    eval_tasks = setting.eval_tasks if args.eval_tasks is None else args.eval_tasks
    together = args.cores_each == 1
    asynchronous = not together
    mode = "async" if asynchronous else "sync"
    if together:
        setup = (f"at the same time, relax-gym pinned to core {args.cores[0]} and TRL to core {args.cores[1]}, "
                 "1 torch thread each; relax-gym sync")
    else:
        setup = (f"one after the other (2 cores on this machine), each alone on cores {set(args.cores)} with 2 torch "
                 "threads; " + ("relax-gym sync" if not asynchronous else "relax-gym async, max_staleness 1, " + (
                     "engine thread on one core and the trainer's own process on the other" if setting.pin_roles
                     else "both roles on both cores (the config's layout)")))
    print(f"vs_trl, setting {setting.name}: {setup}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "setting": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(setting).items()}, "steps": steps,
        "seeds": seeds, "argv": sys.argv[1:], "cores_each": args.cores_each, "relax_mode": mode, "setup": setup,
        "eval_tasks": eval_tasks, "runs": {},
    }
    # two cores, async, the tiny model: relax-gym's engine thread gets one and its trainer the other (`cpu:`), so
    # the async step overlaps rollout and training instead of both spreading over both cores, and the trainer runs
    # in a process of its own (`trainer.own_process`), so its Python does not wait on the rollout's for the GIL
    pinned = (f"cpu.engine.cores=[{args.cores[0]}]", "cpu.engine.threads=1", f"cpu.trainer.cores=[{args.cores[1]}]",
              "cpu.trainer.threads=1", "trainer.own_process=true")
    roles = pinned if asynchronous and setting.pin_roles else ()
    overrides = (*roles, *args.relax_overrides)
    relax_extra = ("--mode", mode, *(("--cli",) if args.cli else ()),
                   *(("--relax-overrides", *overrides) if overrides else ()))
    trl_extra = ("--trl-gradient-checkpointing",) if args.trl_gradient_checkpointing else ()
    for seed in seeds:
        if together:
            procs = {
                "relax": launch(args.relax_python, "relax", setting, seed, steps, [args.cores[0]], out_dir,
                                relax_extra),
                "trl": launch(args.trl_python, "trl", setting, seed, steps, [args.cores[1]], out_dir, trl_extra),
            }
            ended = wait_all(procs, seed)
        else:  # both cores to each side in turn: there are only two
            procs, ended = {}, {}
            runs = [("relax", "relax", args.relax_python, relax_extra)]
            if asynchronous:
                # relax-gym sync on the same placement: T_rollout and T_train without overlap, for async's
                # efficiency, and the reward async must match
                runs.append(("relax_sync", "relax", args.relax_python, ("--mode", "sync", *relax_extra[2:])))
            runs.append(("trl", "trl", args.trl_python, trl_extra))
            for name, framework, python, extra in runs:
                if not drop_page_cache():
                    print("(the page cache could not be dropped: not root)", flush=True)
                procs[name] = launch(python, framework, setting, seed, steps, sorted(set(args.cores)), out_dir,
                                     extra, name=name)
                ended |= wait_all({name: procs[name]}, seed)
        print(f"seed {seed}: " + ", ".join(f"{k} process {v:.1f} s" for k, v in ended.items()), flush=True)
        for name, (_, path) in procs.items():
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            summary["runs"][f"{name}_seed{seed}"] = {**summarize(rows), "process_wall_s": ended[name]}
        relax = summary["runs"][f"relax_seed{seed}"]
        if asynchronous:
            sync = summary["runs"][f"relax_sync_seed{seed}"]["phases"]
            t_rollout, t_train = sync["wait_rollout_s"], sync["logprobs_s"] + sync["train_s"] + sync["weight_sync_s"]
            relax["efficiency"] = {"t_rollout_s": t_rollout, "t_train_s": t_train, "t_step_s": relax["s_per_step"],
                                   "efficiency": max(t_rollout, t_train) / relax["s_per_step"]}
        if setting.floors:
            relax["floors"] = json.loads(procs["relax"][1].with_suffix(".floors.json").read_text())
            relax["vs_floor"] = {
                k: {"s": relax["phases"][k], "floor_s": relax["floors"][f],
                    "x": relax["phases"][k] / relax["floors"][f]}
                for k, f in FLOOR_OF.items()
            }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    if eval_tasks:  # the same command for each model, one after the other on the whole machine
        models = {"base": setting.model} | {
            f"{framework}_seed{seed}": run_dir_of(out_dir / f"{framework}_seed{seed}.jsonl")
            for seed in seeds for framework in ("relax", "trl")
        }
        print(f"held-out eval: {eval_tasks} tasks, greedy, for " + ", ".join(models), flush=True)
        summary["eval"] = {name: held_out(args.relax_python, folder, setting, eval_tasks,
                                          out_dir / f"{name}.eval.jsonl") for name, folder in models.items()}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    batch = setting.groups_per_step * setting.group_size
    print(f"\n{setting.name}: {steps} steps, {setting.groups_per_step} prompts x {setting.group_size} samples; rolling "
          f"window {WINDOW}; s/step over steps {SKIP_STEPS + 1 if steps > SKIP_STEPS else 1}..{steps}; times from the "
          "first step's start")
    print(f"runs: {setup}")
    print("| seed | framework | s/step | train wall s | t to 0.3 (step) | t to 0.4 (step) | final rolling reward | "
          "cut off | process s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    labels = {"relax": f"relax-gym {mode}", "relax_sync": "relax-gym sync", "trl": "TRL"}
    for seed in seeds:
        for name in [n for n in labels if f"{n}_seed{seed}" in summary["runs"]]:
            s = summary["runs"][f"{name}_seed{seed}"]
            print(f"| {seed} | {labels[name]} | {s['s_per_step']:.3f} | {s['wall_s']:.1f} | "
                  f"{fmt(s['t_to_0.3'])} s ({fmt(s['step_to_0.3'], 'd')}) | "
                  f"{fmt(s['t_to_0.4'])} s ({fmt(s['step_to_0.4'], 'd')}) | {s['final_rolling_reward']:.3f} | "
                  f"{s['truncated']:.2f} | {s['process_wall_s']:.1f} |")
    print("\n| seed | s/step relax-gym / TRL | train wall relax-gym / TRL | t to 0.3 relax-gym / TRL | "
          "t to 0.4 relax-gym / TRL |")
    print("|---|---:|---:|---:|---:|")
    for seed in seeds:
        r, t = summary["runs"][f"relax_seed{seed}"], summary["runs"][f"trl_seed{seed}"]
        ratios = [r["s_per_step"] / t["s_per_step"], r["wall_s"] / t["wall_s"]]
        for th in THRESHOLDS:
            a, b = r[f"t_to_{th}"], t[f"t_to_{th}"]
            ratios.append(a / b if a is not None and b is not None else None)
        print(f"| {seed} | " + " | ".join(fmt(x, ".2f") for x in ratios) + " |")
    if eval_tasks:
        base = summary["eval"]["base"]
        print(f"\nheld-out pass@1 (`relax-gym eval`, greedy, {eval_tasks} tasks, 95 % interval), base model "
              f"{base['pass_at_1']:.3f} {interval(base)}:")
        print("| seed | framework | s/step | train wall s | held-out pass@1 base → after |")
        print("|---|---|---:|---:|---|")
        for seed in seeds:
            for name in ("relax", "trl"):
                s, e = summary["runs"][f"{name}_seed{seed}"], summary["eval"][f"{name}_seed{seed}"]
                print(f"| {seed} | {labels[name]} | {s['s_per_step']:.3f} | {s['wall_s']:.1f} | "
                      f"{base['pass_at_1']:.3f} → {e['pass_at_1']:.3f} {interval(e)} |")
    print("\nrelax-gym phase split (mean s per step, steady steps):")
    for seed in seeds:
        p = summary["runs"][f"relax_seed{seed}"]["phases"]
        print(f"  seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()))
    if asynchronous:
        print("\nrelax-gym async efficiency max(T_rollout, T_train) / T_step (T_rollout, T_train: the sync run's "
              "wait_rollout_s and logprobs_s + train_s + weight_sync_s, same placement):")
        print("| seed | T_rollout s | T_train s | T_step async s | efficiency |")
        print("|---|---:|---:|---:|---:|")
        for seed in seeds:
            e = summary["runs"][f"relax_seed{seed}"]["efficiency"]
            print(f"| {seed} | {e['t_rollout_s']:.3f} | {e['t_train_s']:.3f} | {e['t_step_s']:.3f} | "
                  f"{e['efficiency']:.2f} |")
    if not setting.floors:
        return
    print("\nrelax-gym phases against plain-HF floors on the same cores (mean s per steady step; floor: median):")
    print("| seed | phase | relax-gym s | floor | floor s | x floor |")
    print("|---|---|---:|---|---:|---:|")
    for seed in seeds:
        for k, v in summary["runs"][f"relax_seed{seed}"]["vs_floor"].items():
            floor = f"generate, {batch} prompts" if k == "wait_rollout_s" else f"fwd+bwd+AdamW, {batch} seqs"
            print(f"| {seed} | {k} | {v['s']:.3f} | {floor} | {v['floor_s']:.3f} | {v['x']:.2f} |")


def interval(row: dict[str, Any]) -> str:
    low, high = row["pass_at_1_ci"]
    return f"[{low:.3f}, {high:.3f}]"


if __name__ == "__main__":
    main()
