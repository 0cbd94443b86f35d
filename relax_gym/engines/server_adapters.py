"""`relax-gym serve`'s LoRA adapters: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`, and the adapters
`serve --lora-paths` loads before it serves. A request runs on one by naming it (`/generate`'s `lora_path`, a
chat's `model`)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from relax_gym.engines.base import RequestError
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.server_schemas import LoadAdapterIn, UnloadAdapterIn
from relax_gym.errors import StartupError


def adapter_routes(engine: EmbeddedEngine) -> APIRouter:
    """The adapter routes over `engine`."""
    router = APIRouter()

    def _adapters_answer(error: str | None = None) -> JSONResponse:
        """SGLang's answer to both adapter routes: success, its error, and the adapters loaded by name."""
        return JSONResponse({"success": error is None, "error_message": error,
                             "loaded_adapters": dict(engine.adapters.folders)}, status_code=400 if error else 200)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterIn) -> JSONResponse:
        """Loads a PEFT adapter folder (safetensors only) by name, beside the base and the adapters loaded."""
        try:
            await engine.load_adapter(body.lora_name, body.lora_path)
        except RequestError as err:
            return _adapters_answer(str(err))
        return _adapters_answer()

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterIn) -> JSONResponse:
        try:
            await engine.unload_adapter(body.lora_name)
        except RequestError as err:
            return _adapters_answer(str(err))
        return _adapters_answer()

    return router


async def load_adapters(engine: EmbeddedEngine, adapters: Mapping[str, str]) -> None:
    """Loads each adapter folder under its name; a StartupError names the first that does not load."""
    for name, folder in adapters.items():
        try:
            await engine.load_adapter(name, folder)
        except RequestError as err:
            raise StartupError(f"relax-gym serve --lora-paths {name}={folder}: {err}") from None

