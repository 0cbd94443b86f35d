"""Makes the quickstart's warm-start checkpoint: the tiny model, briefly fine-tuned on the answer format.

RL improves a policy that already answers in the right form; from random
weights a tiny model almost never emits a parseable integer, so rewards are
all zero and nothing can be learned in minutes. This script trains the
seeded tiny model on `relax/Arithmetic-v0` prompts with their answers, and
stops once the expected accuracy of *sampling* (the mean probability the model
gives the whole correct answer) reaches `--target` (default 0.1), leaving RL
most of the work. Deterministic: same seed, same checkpoint.

    python scripts/make_warmstart.py [--out examples/checkpoints/tiny-arithmetic] [--target 0.1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import relax_gym
from relax_gym.models import load_model, render_ids, save_model

ENV_ID = "relax/Arithmetic-v0"


def examples(loaded, seeds: range) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + end of turn) for each seed's task, rendered as the rollout renders it."""
    env = relax_gym.make(ENV_ID)
    tok = loaded.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        prompt = render_ids(loaded, env.format_observation(obs), add_generation_prompt=True)
        answer = tok(str(env.task["answer"]), add_special_tokens=False)["input_ids"] + [end]
        out.append((prompt, answer))
    return out


def answer_logprobs(model, batch: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Sum of log p(answer tokens | prompt) per example (right-padded batch)."""
    seqs = [p + a for p, a in batch]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = torch.zeros_like(logp)
    for i, (p, a) in enumerate(batch):
        mask[i, len(p) - 1: len(p) - 1 + len(a)] = 1.0
    return (logp * mask).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="examples/checkpoints/tiny-arithmetic")
    parser.add_argument("--target", type=float, default=0.1, help="stop at this expected sampled accuracy")
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    loaded = load_model("tiny")
    model = loaded.model
    train = examples(loaded, range(0, 2000))
    held_out = examples(loaded, range(10_000, 10_200))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    accuracy = 0.0
    for step in range(1, args.max_steps + 1):
        idx = torch.randint(len(train), (64,), generator=generator).tolist()
        model.train()
        loss = -answer_logprobs(model, [train[i] for i in idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                accuracy = answer_logprobs(model, held_out).exp().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, expected sampled accuracy {accuracy:.3f}")
            if accuracy >= args.target:
                break
    model.eval()
    out = save_model(loaded, Path(args.out))
    print(f"saved {out} (expected sampled accuracy {accuracy:.3f})")


if __name__ == "__main__":
    main()
