"""Several LoRA adapters of one base resident in an engine's model at once, each batch row on its own (multi-LoRA
serving: what SGLang's and vLLM's `--enable-lora` do), through peft.

peft injects each loaded adapter's layers beside the base layer it adapts and leaves the base weights as they
were; a LoRA layer given `adapter_names` (one per batch row; `BASE` for none) adds to each row only its own
adapter's update, unmerged (peft's mixed-adapter batches). `rows` hands every LoRA layer those names for the
forwards inside it, through a forward pre-hook of our own on each of peft's public `LoraLayer`s, put on once as the
layer appears: peft's own context hooks every layer again per call and takes one list for every forward, while the
engine's forwards differ in size (a prompt prefix shared by a group runs once, identical prompts once). A batch
all of one adapter runs on peft's active adapter instead, with no per-row gather (SmolLM2, 16 rows, one decode
forward, no cache, on an AMD EPYC: base 89 ms, one adapter active 113 ms, the same rows named one by one 135 ms).

An adapter folder is read only from its safetensors (`adapter_model.safetensors`), never a pickle.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from relax_gym.engines.base import RequestError
from relax_gym.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, quiet_peft

__all__ = ["BASE", "ResidentAdapters"]

#: peft's name for "no adapter" in a mixed batch
BASE = "__base__"


class ResidentAdapters:
    """The adapters loaded into one model, by name; the model is untouched until the first is loaded and is a
    plain transformers model again once the last is unloaded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._peft: Any = None  # the PeftModel while any adapter is loaded
        self._hooks: dict[nn.Module, Any] = {}  # each LoRA layer's pre-hook (`_name_rows`), by layer
        #: the adapter names of the forwards running now (one: every row's), None: peft's active adapter
        self._names: list[str] | None = None
        #: name -> the folder it was loaded from, in load order
        self.folders: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.folders)

    def load(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Loads the PEFT adapter folder as `name`; refused (RequestError) for a name in use, a folder that is no
        adapter, or an adapter that does not fit this model (another base, other layers)."""
        path = Path(folder).expanduser()
        if not name or name == BASE:
            raise RequestError(f"lora_name: {name!r} cannot name an adapter")
        if name in self.folders:
            raise RequestError(f"lora_name: an adapter named {name!r} is already loaded (from {self.folders[name]});"
                               " unload it first")
        missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / f).is_file()]
        if missing:
            raise RequestError(f"lora_path: {path} is no PEFT adapter folder (it lacks {', '.join(missing)})")
        kind = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("peft_type")
        if kind != "LORA":
            raise RequestError(f"lora_path: {path} holds a {kind} adapter; only LoRA adapters are served")
        try:
            # peft's warnings (a base renamed, keys missing) are this method's own checks, said in its error
            with quiet_peft(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                if self._peft is None:  # peft's `from_pretrained`, but keeping `load_adapter`'s result to check
                    from peft import PeftConfig, get_peft_model

                    config = PeftConfig.from_pretrained(str(path))
                    config.inference_mode = True
                    self._peft = get_peft_model(self.model, config, adapter_name=name)
                result = self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
            # peft's own filter of the missing keys matches the name anywhere in a key ("b" in "base_model")
            stray = [*(k for k in result.missing_keys if f".{name}." in k), *result.unexpected_keys]
            if stray:
                raise ValueError(f"{len(stray)} of its weights name no layer of this model's, e.g. {stray[0]}")
        except (RuntimeError, ValueError, KeyError) as err:  # a size mismatch, a target the model lacks
            if self._peft is not None and name in self._peft.peft_config:
                self._peft.delete_adapter(name)
            if not self.folders:
                self._release()
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise RequestError(f"lora_path: the adapter at {path} does not fit this model (another base, or "
                               f"layers it lacks): {reason}") from None
        self.model.eval()
        self.folders[name] = str(path)
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():  # an adapter of other targets brings layers of its own
            if isinstance(module, LoraLayer) and module not in self._hooks:
                self._hooks[module] = module.register_forward_pre_hook(self._name_rows, with_kwargs=True)

    def unload(self, name: str) -> None:
        """Removes adapter `name`; RequestError naming the loaded ones if there is none of that name."""
        if name not in self.folders:
            raise RequestError(f"lora_name: no adapter named {name!r} is loaded; loaded: {sorted(self.folders)}")
        del self.folders[name]
        if self.folders:
            with warnings.catch_warnings():  # "Adapter x was active which is now deleted": nothing is active here
                warnings.simplefilter("ignore", UserWarning)
                self._peft.delete_adapter(name)
        else:
            self._release()

    def _release(self) -> None:
        """The model without peft's layers, as it was before the first adapter."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        if self._peft is not None:
            self._peft.base_model.unload()
            self._peft = None

    def check(self, name: str | None) -> None:
        """RequestError unless `name` (a request's adapter) is None or loaded."""
        if name is not None and name not in self.folders:
            raise RequestError(f"lora_path: no adapter named {name!r} is loaded; loaded: {sorted(self.folders)}")

    @contextmanager
    def rows(self, names: str | Sequence[str | None] | None) -> Iterator[None]:
        """The forwards inside run each batch row on its adapter: `names` has one per row (None: the base), or is
        one name (or None) for every row of any batch. Nothing happens while no adapter is loaded."""
        if not self.folders:
            yield
            return
        listed: Sequence[str | None] = [names] if isinstance(names, str) or names is None else names
        given = [BASE if n is None else n for n in listed]
        if len(set(given)) == 1 and given[0] != BASE:  # peft's plain forward on its active adapter
            if self._peft.active_adapter != given[0]:
                self._peft.base_model.set_adapter(given[0], inference_mode=True)
            yield
            return
        self._names = given[:1] if len(set(given)) == 1 else given
        try:
            yield
        finally:
            self._names = None

    def _name_rows(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A LoRA layer's pre-hook: the running forward's adapter names as its `adapter_names`, one a row."""
        names = self._names
        if names is None:
            return None
        rows = (args[0] if args else kwargs["x"]).shape[0]
        if len(names) > 1 and rows != len(names):
            raise RuntimeError(f"a forward of {rows} rows was given {len(names)} adapter names")
        return args, {**kwargs, "adapter_names": names * rows if len(names) == 1 else names}
