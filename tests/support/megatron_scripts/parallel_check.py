"""`run_checks` on a TP/PP/DP/EP layout under `python -m torch.distributed.run`; rank 0 writes the numbers as JSON.

    cd tests && python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m support.megatron_scripts.parallel_check --tp 2 --out /tmp/tp2.json --workdir /tmp/tp2

Every rank builds the same tiny model (seeded), so each can compute the HF
reference itself; the checkpoint folder must be shared by the ranks.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch.distributed as dist

from relax_gym.models import load_model
from support.megatron_scripts.common import GRAD_CLIP, LR, MICRO_BATCH_TOKENS, WEIGHT_DECAY, run_checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--model", default="tiny", help="a tiny model: tiny, or tiny-moe (with --ep)")
    parser.add_argument("--logprob-chunk-rows", type=int, help="rows of the logprob's working chunk (default: "
                        "its memory budget's, one chunk for the tiny model)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")

    t0 = time.perf_counter()
    from relax_gym.trainer.backends.megatron import MegatronBackend

    hf_model = load_model(args.model).model.eval()
    import_s = time.perf_counter() - t0
    if args.logprob_chunk_rows:
        from relax_gym.trainer.backends import logprob_kernel

        logprob_kernel.CHUNK_ELEMENTS = args.logprob_chunk_rows * hf_model.config.vocab_size // args.tp

    def make_backend() -> MegatronBackend:
        return MegatronBackend(hf_model, tp=args.tp, pp=args.pp, ep=args.ep, lr=LR, weight_decay=WEIGHT_DECAY,
                               grad_clip=GRAD_CLIP, micro_batch_tokens=MICRO_BATCH_TOKENS, seed=0)

    result = run_checks(make_backend, hf_model, args.workdir)
    result |= {"import_s": import_s, "world": dist.get_world_size(), "tp": args.tp, "pp": args.pp, "ep": args.ep}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
