"""A FAKE of `python -m sglang.launch_server` 0.5.23, for the machines SGLang cannot run on (no GPU here).

It takes SGLang's own launch arguments (`--model-path`, `--host`, `--port`, `--tp-size`, `--api-key`,
`--enable-deterministic-inference`, and ignores other SGLang flags it is given) and serves `relax-gym serve`'s
app, which answers SGLang's native routes (`/generate`, `/health`, `/update_weights_from_disk`, the weight-update
session, `/init_weights_update_group`, ...), with what 0.5.23 answers differently put over it, as read from
0.5.23's own `http_server.py` and `scheduler_components/weight_updater.py`:

- `/server_info` (and its older name `/get_server_info`) is SGLang's: its `version`, launch arguments and a
  `weight_version` fixed at launch ("default"); no `backend`, so a client takes it for SGLang;
- `/model_info` reports the live `weight_version`, "default" until the first update;
- `/flush_cache` answers SGLang's plain text, 200 or 400;
- tensor and distributed updates outside a weight-update session are refused (400) with SGLang's message:
  `relax-gym serve` itself follows 0.5.23 there; `/get_weight_version` is a 404, as in 0.5.21+;
- without `--enable-lora`, `/load_lora_adapter` is refused (400) with SGLang's message; with it, the LoRA routes
  are `relax-gym serve`'s, which take and answer 0.5.23's bodies (`io_struct.py`'s `LoadLoRAAdapterReqInput`,
  `UnloadLoRAAdapterReqInput`, `LoRAUpdateOutput`; `lora_path` in `/generate` names a loaded adapter).

So the code that launches, supervises and drives an SGLang server runs for real; only the server is a stand-in.
What it does not reproduce: SGLang's own tokenizer and scheduler, `--tp-size` above 1, and its refusal of
`safetensors_b64` (a field it does not have; the client sends that only to `relax-gym serve`).

    python tests/support/fake_sglang_server.py --model-path M --host H --port P [--tp-size N] [--api-key K] [...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: the release this fake answers as
VERSION = "0.5.23"
#: SGLang 0.5.23's refusal of a LoRA load by a server launched without --enable-lora, word for word
LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
#: SGLang 0.5.23's /flush_cache answers, word for word
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")
NOT_FLUSHED = "Flush cache failed.\n"


def sglang_app(engine: Any, *, api_key: str | None, model_path: str, version: str = VERSION,
               deterministic: bool = True, enable_lora: bool = True) -> Any:
    """`relax-gym serve`'s app over `engine`, answering as SGLang `version` where 0.5.23 differs from it."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, PlainTextResponse

    from relax_gym.engines import create_app

    app = create_app(engine, api_key=api_key)
    sglang = APIRouter()
    launched = {"version": version, "frontend": "python", "model_path": model_path, "tokenizer_path": model_path,
                "tp_size": 1, "dp_size": 1, "weight_version": "default",
                "enable_deterministic_inference": deterministic}

    @sglang.get("/server_info")
    @sglang.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return dict(launched)

    @sglang.get("/model_info")
    @sglang.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        current = engine.weight_version
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(current) if current else "default",
                "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
                "architectures": None}

    @sglang.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse(NOT_FLUSHED if engine.busy else FLUSHED, status_code=400 if engine.busy else 200)

    if not enable_lora:
        @sglang.post("/load_lora_adapter")
        async def lora_not_enabled() -> JSONResponse:
            return JSONResponse({"success": False, "error_message": LORA_NOT_ENABLED, "loaded_adapters": None},
                                status_code=400)

    app.router.routes[:0] = sglang.routes  # matched first: these answer as SGLang, the rest as relax-gym serve
    return app


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--api-key")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    args, _other_sglang_flags = parser.parse_known_args(argv)
    if args.tp_size != 1:
        raise SystemExit(f"fake sglang: --tp-size {args.tp_size}: the stand-in serves on one device")
    import asyncio

    import uvicorn

    from relax_gym.engines import EmbeddedEngine, ServerLimits
    from relax_gym.engines.server import uvicorn_config
    from relax_gym.models import load_model

    engine = EmbeddedEngine(load_model(args.model_path), max_batch_size=1)
    app = sglang_app(engine, api_key=args.api_key, model_path=args.model_path,
                     deterministic=args.enable_deterministic_inference, enable_lora=args.enable_lora)
    try:
        uvicorn.Server(uvicorn_config(app, args.host, args.port, ServerLimits(), log_level="info")).run()
    finally:
        asyncio.run(engine.close())


if __name__ == "__main__":
    main(sys.argv[1:])
