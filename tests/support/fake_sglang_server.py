"""A FAKE of `python -m sglang.launch_server`, for the machines SGLang cannot run on (no GPU here).

It takes SGLang's own launch arguments (`--model-path`, `--host`, `--port`, `--tp-size`, `--api-key`, and
ignores other SGLang flags it is given) and serves `relax-gym serve`'s app, which answers SGLang's native routes
(`/generate`, `/health`, `/health_generate`, `/update_weights_from_disk`, `/init_weights_update_group`, ...).
So the code that launches, supervises and drives an SGLang server runs for real; only the server is a stand-in.

    python tests/support/fake_sglang_server.py --model-path M --host H --port P [--tp-size N] [--api-key K] [...]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--api-key")
    args, _other_sglang_flags = parser.parse_known_args(argv)
    if args.tp_size != 1:
        raise SystemExit(f"fake sglang: --tp-size {args.tp_size}: the stand-in serves on one device")
    from relax_gym.engines.base import API_KEY_ENV
    from relax_gym.engines.server import serve

    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key  # SGLang takes the key as a flag; relax-gym serve never does
    serve(args.model_path, host=args.host, port=args.port, max_batch_size=1)


if __name__ == "__main__":
    main(sys.argv[1:])
