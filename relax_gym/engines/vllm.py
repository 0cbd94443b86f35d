"""The `Engine` protocol over a vLLM server's token-in route and RL routes (vLLM 0.32), and a launcher for one.

Token in, token out: `/inference/v1/generate` takes the prompt's ids and answers the sampled ids, each with its
logprob and the weight version that made it (`weight_versions` spans). The server must run with
`VLLM_SERVER_DEV_MODE=1` (the RL and dev routes), `--enable-scale-out` (the token route) and
`--logprobs-mode processed_logprobs` (logprobs after the temperature: vLLM's default reports the raw logits'
softmax); `launch_vllm_server` starts one so, and `connect()` says in one line which of them a server lacks.

What maps to what:
- a weight push (`update_weights`) is a folder: `/collective_rpc` `reload_weights` with `weights_path`, then
  `/update_weight_version`. vLLM 0.32's tensor transports (NCCL, CUDA IPC) need a GPU, so a state dict is
  refused with the setting to use (`rollout.weight_sync: disk`);
- `pause()` is `/pause?mode=keep`: running requests stay where they are and go on after `/resume` (vLLM
  recomputes their cache with the new weights), so an answer spans the update and each token keeps its own
  version, with no request sent twice;
- a LoRA adapter folder (`adapter_config.json`: what a LoRA run pushes) is loaded by name instead
  (`/v1/load_lora_adapter`, the server started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):
  `relax-gym-{run}-v{version}` (`pushed_adapters`), which every later request names as its `model`. A request
  keeps the adapter it started with, so all its tokens have that adapter's version; the newest `keep_adapters`
  stay loaded (a run keeps `max_staleness + 1`, so a request of the oldest version it may still train on finishes
  on its own adapter), and older ones are unloaded;
- `abort(rid)` is `/inference/v1/abort_requests` (vLLM prefixes a request id with "generate-tokens-"): the
  answer comes back with the tokens so far and finish_reason "abort";
- stop ids, seeds and the sampling params are vLLM's own fields; a prompt and budget past the model's context are
  refused here, naming the field, since vLLM would run such a request to its context's end.

Seeds: vLLM 0.32's CPU engine dies (`RuntimeError: CPU Generator does not use offset`, every client's request
failing with it) when a seeded request's prefill is split over steps. `connect()` reads the server's config: on a
CPU server with chunked prefill on, seeds are not sent (samples will not repeat; one warning says how to launch it
instead), and `launch_vllm_server` turns chunked prefill off with a step budget of the whole context. Images,
audio and video are not sent: this client is text-only (vLLM's CPU build would run its own processor, so the
prompt it ran would not be the trajectory's).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_gym.engines.base import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    SamplingParams,
    check_fits,
)
from relax_gym.engines.http_engine import (
    OUTAGE_TIMEOUT_S,
    HTTPEngine,
    ServerProcess,
    span_versions,
    start_server,
    version_number,
)
from relax_gym.engines.pushed_adapters import KEEP_ADAPTERS, PushedAdapters
from relax_gym.errors import StartupError

logger = logging.getLogger("relax_gym.engines")

#: the release whose routes this client speaks (`/version` says which a server is)
VLLM_RELEASE = (0, 32)
#: vLLM's prefix of a token-route request id, which `/inference/v1/abort_requests` takes
RID_PREFIX = "generate-tokens-"
#: how one launches a server this client can drive (the environment variable, then the flags)
LAUNCH_HINT = ("VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model M --enable-scale-out "
               "--logprobs-mode processed_logprobs --no-enable-chunked-prefill --max-num-batched-tokens N "
               "(N >= --max-model-len), or let the run start it (rollout.engine: vllm without engine_url)")
#: the ranks vLLM 0.32's `--max-lora-rank` takes (`vllm.config.lora.MaxLoRARanks`)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_HINT = ("start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank R (R >= "
             "trainer.lora.rank), --max-loras K (K >= trainer.max_staleness + 1), or let the run start it")
#: the command that installs vLLM where relax_gym looks for it (its own venv: it pins its own torch)
INSTALL_HINT = "bash scripts/setup_vllm_venv.sh"


def _config_value(config: str, name: str) -> str | None:
    """A field of vLLM's `/server_info` `vllm_config`, which is the config's repr ("name=value, ...")."""
    found = re.search(rf"\b{re.escape(name)}=([^,)]+)", config)
    return found.group(1).strip() if found else None


class VLLMEngine(HTTPEngine):
    """An httpx client of one vLLM server at `base_url` (the connection's settings are `HTTPEngine`'s)."""

    #: a pickled copy (a rollout worker's) knows the adapters the server holds, so its requests name the newest
    _carried = ("adapters",)

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        outage_timeout_s: float = OUTAGE_TIMEOUT_S,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        retries: int | None = None,
        max_connections: int | None = None,
        api_key: str | None = None,
        expected_model: str | None = None,
        keep_adapters: int = KEEP_ADAPTERS,
    ) -> None:
        """`expected_model` (the run's model folder) is checked against what the server serves at `connect()`;
        `keep_adapters`: how many pushed LoRA adapters stay loaded (the newest)."""
        super().__init__(base_url, timeout_s=timeout_s, outage_timeout_s=outage_timeout_s, backoff_s=backoff_s,
                         max_backoff_s=max_backoff_s, retries=retries, max_connections=max_connections,
                         api_key=api_key, expected_model=expected_model)
        self.expected_model = expected_model
        #: the server this client started (`vllm_engine`), stopped by `close()`
        self.server: VLLMServer | None = None
        self.context_length: int | None = None
        #: whether requests carry their seeds (False on a server whose engine dies of them: see the module doc)
        self.seeded = True
        #: the pushed adapters loaded, oldest first; requests name the newest
        self.adapters = PushedAdapters(keep_adapters)

    async def connect(self) -> dict[str, Any]:
        """Waits for the server, resumes it (a killed trainer may have left it paused), and checks it is a vLLM
        this client drives, serving the run's model, with the routes and logprobs it needs: a RequestError with
        one line naming the URL and what differs otherwise. Returns what it read of the model."""
        where = f"vLLM at {self.base_url}"
        await self._request("GET", "/health", None)
        release = str((await self._request("GET", "/version", None)).json().get("version", ""))
        if tuple(int(p) for p in re.findall(r"\d+", release)[:2]) < VLLM_RELEASE:
            raise RequestError(f"{where} is vLLM {release}; relax_gym drives vLLM "
                               f"{'.'.join(map(str, VLLM_RELEASE))} or later (its RL routes)")
        try:
            await self._request("POST", "/resume", None)
        except RequestError as err:
            if err.status != 404:
                raise
            raise RequestError(f"{where} has no RL routes (/pause, /resume, /collective_rpc): start it with "
                               f"VLLM_SERVER_DEV_MODE=1 ({LAUNCH_HINT})") from None
        model = (await self._request("GET", "/v1/models", None)).json()["data"][0]
        self.context_length = int(model["max_model_len"])
        served = str(model.get("root") or model["id"])
        if self.expected_model is not None and not _same_model(served, self.expected_model):
            raise RequestError(f"{where} serves {served!r}, not the run's model {self.expected_model!r}")
        await self._check_logprobs(where)
        config = str((await self._request("GET", "/server_info", None)).json().get("vllm_config", ""))
        if _config_value(config, "device_config") == "cpu" and _config_value(config, "enable_chunked_prefill") \
                == "True":
            self.seeded = False
            logger.warning("%s splits prefills over steps (chunked prefill), where vLLM 0.32's CPU engine dies of a "
                           "seeded request: seeds are not sent, so its samples will not repeat from run to run; "
                           "start it with --no-enable-chunked-prefill --max-num-batched-tokens >= max_model_len to "
                           "seed them", where)
        version = (await self._request("GET", "/weight_info", None)).json().get("weight_version")
        self._version = version_number(version, self._version)
        return {"model_path": served, "context_length": self.context_length, "weight_version": version,
                "version": release}

    async def _check_logprobs(self, where: str) -> None:
        """The token route is on, and its logprobs are after the temperature: the likeliest first token's logprob
        differs between temperatures 1 and 2 under `processed_logprobs`, not under vLLM's raw default."""
        tops = []
        for temperature in (1.0, 2.0):
            payload = {"token_ids": [0], "sampling_params": {"temperature": temperature, "max_tokens": 1,
                                                               "logprobs": 1, "top_p": 1.0, "top_k": 0}}
            try:
                body = (await self._request("POST", "/inference/v1/generate", payload)).json()
            except RequestError as err:
                if err.status in (403, 404):
                    raise RequestError(f"{where} does not serve /inference/v1/generate: start it with "
                                       f"--enable-scale-out ({LAUNCH_HINT})") from None
                raise
            tops.append(max(t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]))
        if abs(tops[0] - tops[1]) < 1e-6:
            raise RequestError(f"{where} reports logprobs before the temperature (vLLM's default raw_logprobs): "
                               f"start it with --logprobs-mode processed_logprobs ({LAUNCH_HINT})")

    def _params(self, sampling: SamplingParams) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": sampling.top_k, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
                                  "min_p": 0.0, "repetition_penalty": 1.0}
        if sampling.stop:
            raise RequestError("sampling.stop: vLLM's token route stops on ids only; give stop_token_ids")
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None and self.seeded:
            params["seed"] = sampling.seed
        return params

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One request; its logprobs are log softmax(logits / T) of the untruncated distribution where top_p is 1
        and top_k 0 (vLLM's processed logprobs are those of the truncated one otherwise)."""
        if request.images or request.audios or request.videos or request.mm_inputs:
            raise RequestError("images, audio and video: the vLLM client is text-only (vLLM would run its own "
                               "processor on the prompt, so its tokens would not be the trajectory's)")
        if self.context_length is not None:
            check_fits(len(request.input_ids), request.sampling.max_new_tokens, self.context_length, "input_ids",
                       "sampling.max_new_tokens")
        payload: dict[str, Any] = {"token_ids": list(request.input_ids), "sampling_params": self._params(
            request.sampling)}
        if request.rid is not None:
            payload["request_id"] = request.rid
        adapter = self.adapters.newest if request.adapter is None else None
        if adapter is not None:  # the request runs on the newest adapter to its end, whatever is pushed meanwhile
            payload["model"] = adapter[0]
        elif request.adapter is not None:  # an adapter of the caller's own, loaded by name: vLLM's `model`
            payload["model"] = request.adapter
        before = self._version  # what a span's "default" (vLLM's version before any update) stands for
        body = (await self._request("POST", "/inference/v1/generate", payload)).json()
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        if [int(c["token_id"]) for c in content] != ids:
            raise EngineError(f"server at {self.base_url}: the logprobs' tokens do not match token_ids")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"server at {self.base_url}: unexpected finish_reason {reason!r}")
        logprobs = [float(c["logprob"]) for c in content]
        if adapter is not None:
            return GenerateOutput(ids, logprobs, reason, adapter[1], len(request.input_ids), [adapter[1]] * len(ids))
        spans = choice.get("weight_versions") or []
        if spans:
            self._version = version_number(spans[-1].get("version"), self._version)
        return GenerateOutput(ids, logprobs, reason, self._version, len(request.input_ids),
                              span_versions(spans, len(ids), before))

    async def update_weights(self, weights: Any, version: int) -> None:
        """A folder: every worker reloads its weights from it, then the server takes `version`."""
        if isinstance(weights, Mapping):
            raise RequestError("update_weights: vLLM 0.32 takes a state dict only over NCCL or CUDA IPC (a GPU); "
                               "send a folder (rollout.weight_sync: disk)")
        if not isinstance(weights, (str, os.PathLike)):
            raise RequestError(f"update_weights: expected a folder path, got {type(weights)}")
        if (Path(weights) / "adapter_config.json").is_file():
            await self._load_adapter(Path(weights), version)
            return
        await self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(weights)},
                                                        "timeout": self.timeout_s})
        await self._request("POST", "/update_weight_version", {"new_version": str(version)})
        self._version = version

    async def _load_adapter(self, folder: Path, version: int) -> None:
        """Loads the PEFT adapter folder as `relax-gym-{run}-v{version}` for every later request, then unloads the
        adapters older than the newest `keep_adapters` (`PushedAdapters.load`)."""
        try:
            await self.adapters.load(self._request, folder, version, load_route="/v1/load_lora_adapter",
                                     unload_route="/v1/unload_lora_adapter")
        except RequestError as err:
            if err.status == 404:
                raise RequestError(f"vLLM at {self.base_url} cannot load LoRA adapters: {LORA_HINT}") from None
            raise
        self._version = version

    async def pause(self) -> None:
        """vLLM's keep mode: nothing is scheduled until `resume`; running requests wait where they are."""
        await self._request("POST", "/pause", None, params={"mode": "keep"})

    async def resume(self) -> None:
        await self._request("POST", "/resume", None)

    async def close(self) -> None:
        await super().close()
        if self.server is not None:
            self.server.stop()

    async def abort(self, rid: str) -> None:
        """Ends request `rid` now; its `generate` returns the tokens so far with finish_reason "abort"."""
        await self._request("POST", "/inference/v1/abort_requests", {"request_ids": [RID_PREFIX + rid]})


def _same_model(served: str, expected: str) -> bool:
    """Whether the server's model is the run's: the same folder, or one of the same name (a copy elsewhere)."""
    return Path(served).resolve() == Path(expected).resolve() or Path(served).name == Path(expected).name


def vllm_python() -> str:
    """The Python that has vLLM: `RELAX_GYM_VLLM_PYTHON`, else the venv `scripts/setup_vllm_venv.sh` makes, else
    this one if it has vLLM; an EngineError naming the install command otherwise."""
    candidates = [os.environ.get("RELAX_GYM_VLLM_PYTHON"), str(vllm_venv() / "bin" / "python")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise EngineError(f"vLLM is not installed: run `{INSTALL_HINT}` (vLLM pins its own torch, so it gets a venv of "
                      f"its own at {vllm_venv()}), or set RELAX_GYM_VLLM_PYTHON to a Python that has it")


def vllm_venv() -> Path:
    """Where `scripts/setup_vllm_venv.sh` installs vLLM: `$RELAX_GYM_VLLM_VENV`, default ~/.cache/relax_gym/vllm."""
    return Path(os.environ.get("RELAX_GYM_VLLM_VENV", Path.home() / ".cache" / "relax_gym" / "vllm"))


#: a vLLM API server subprocess
VLLMServer = ServerProcess


def server_args(model: str | os.PathLike, port: int, host: str = "127.0.0.1", *, max_model_len: int = 2048,
                dtype: str = "float32", api_key: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The server's arguments that this client needs (see the module doc), and the ones that start it fastest
    on a CPU: eager mode, which also skips the warm-up once the KV cache's size is set."""
    args = ["--model", str(model), "--host", host, "--port", str(port), "--enforce-eager", "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs", "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(max_model_len, 2048)), "--max-model-len", str(max_model_len),
            "--dtype", dtype]
    if api_key:
        args += ["--api-key", api_key]
    return [*args, *extra]


def lora_args(rank: int, adapters: int) -> list[str]:
    """The flags that let a server load adapters of `rank` at runtime, `adapters` at once."""
    max_rank = next((r for r in LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise RequestError(f"trainer.lora.rank={rank}: vLLM 0.32 serves adapters of rank {LORA_RANKS[-1]} at most")
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(adapters),
            "--max-cpu-loras", str(adapters)]


def launch_vllm_server(
    model: str | os.PathLike, port: int, *, host: str = "127.0.0.1", max_model_len: int = 2048,
    dtype: str = "float32", api_key: str | None = None, extra: Sequence[str] = (), kv_cache_gib: int = 2,
    cpus: str | None = None, timeout_s: float = 600.0, die_with_parent: bool = False,
    lora: tuple[int, int] | None = None,
) -> VLLMServer:
    """Starts vLLM's API server on `model` (a local folder) and waits until /health answers 200; its log goes to
    a temp file. On a CPU it computes on `cpus` (default: every CPU this process may use; vLLM would otherwise
    keep one core to itself) with a KV cache of `kv_cache_gib`. `die_with_parent` has the kernel end it when
    the thread that started it ends (Linux). `lora` (rank, adapters): it also loads LoRA adapters at runtime."""
    python = vllm_python()
    allowed = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cpus or f"{allowed[0]}-{allowed[-1]}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if lora is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        extra = [*lora_args(*lora), *extra]
    env.pop("PYTHONPATH", None)  # its venv's packages, not this one's
    return start_server([python, "-m", "vllm.entrypoints.openai.api_server",
                         *server_args(model, port, host, max_model_len=max_model_len, dtype=dtype, api_key=api_key,
                                      extra=extra)],
                        f"http://{host}:{port}", "vLLM's server", timeout_s=timeout_s,
                        die_with_parent=die_with_parent, env=env, cwd=tempfile.gettempdir())


def model_folder(loaded: Any) -> str:
    """A folder vLLM can load `loaded` from: its own, else the model saved to a temporary one (a tiny model, a
    GGUF file)."""
    if os.path.isdir(loaded.name):
        return str(loaded.name)
    from relax_gym.models import save_model

    return str(save_model(loaded, tempfile.mkdtemp(prefix="relax-gym-vllm-model-")))


def vllm_engine(loaded: Any, settings: Any, lora: tuple[int, int] | None = None) -> Any:
    """The engine `rollout.engine: vllm` names: a client of `engine_url`, a router over `engine_urls`, or, with
    neither, a client of a server started here on `loaded`'s folder (the model saved to a temporary folder first
    where it has none, e.g. a tiny model), in its dtype, stopped when the client closes. `lora` (rank, adapters
    kept): the clients keep that many pushed adapters loaded, and a server started here loads adapters."""
    from relax_gym.engines.router import MEMBER_OUTAGE_TIMEOUT_S, MEMBER_RETRIES, EngineRouter

    keep = lora[1] if lora is not None else KEEP_ADAPTERS
    folder = loaded.name if os.path.isdir(loaded.name) else None
    if settings.engine_urls:
        return EngineRouter({url: VLLMEngine(url, outage_timeout_s=MEMBER_OUTAGE_TIMEOUT_S, retries=MEMBER_RETRIES,
                                             expected_model=folder, keep_adapters=keep)
                             for url in settings.engine_urls}, wait_s=settings.engine_outage_timeout_s)
    if settings.engine_url:
        return VLLMEngine(settings.engine_url, outage_timeout_s=settings.engine_outage_timeout_s,
                          expected_model=folder, keep_adapters=keep)
    folder = model_folder(loaded)
    dtype = settings.engine_dtype if settings.engine_dtype != "auto" else \
        str(loaded.model.dtype).removeprefix("torch.")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = loaded.model.config
    context = getattr(getattr(config, "text_config", config), "max_position_embeddings", None) or 4096
    logger.info("starting vLLM on %s (port %d; about a minute on a CPU)", folder, port)
    try:  # the context an episode may use, not the model's whole one: vLLM sizes its step budget by it
        server = launch_vllm_server(folder, port, dtype=dtype, lora=lora,
                                    max_model_len=min(int(context), settings.max_total_tokens), die_with_parent=True)
    except EngineError as err:  # not installed, or it would not start: nothing of the run has started
        raise StartupError(f"rollout.engine=vllm: {err}") from None
    engine = VLLMEngine(server.url, outage_timeout_s=settings.engine_outage_timeout_s, expected_model=folder,
                        keep_adapters=keep)
    engine.server = server
    return engine
