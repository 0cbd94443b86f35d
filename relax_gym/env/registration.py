"""Env ids: register, make, spec, list.

Ids follow gymnasium's grammar (`namespace/Name-vN`) and every id is also put in
gymnasium's own registry, so `gymnasium.make(id)` gives the same env wrapped in
gymnasium's usual checkers. `relax_gym.make` returns the unwrapped env, since
the rollout manager needs `format_observation` and the async methods, which
gymnasium's wrappers no longer forward.

Commands take env *targets*, not only ids: `resolve_env_id` turns a
`file.py`, a module, or `source:NAME` into the registered id it names, and
`import_env_source` is the one place a file or module is imported for its ids.

A *namespace* registered with `register_namespace` builds its ids on first lookup: an ecosystem with hundreds
of games (`textarena/TicTacToe-v0`, `gem/game:Sudoku-v0-easy`) gets every one by name without a list here that
would go stale; the part after the slash is handed to the env as one keyword.

Third-party packages add ids through the `relax_gym.envs` entry-point group.
Those are loaded on the first lookup (`make`, `spec`, `list_envs`, ...), not at
import, so `import relax_gym.engines` on every torchrun rank runs no plugin
code. This module names no env: the bundled ones are registered by the
package itself (`relax_gym/__init__.py` imports `relax_gym.envs`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec, load_env_creator, parse_env_id

from relax_gym.env.core import Env

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "relax_gym.envs"

registry: dict[str, EnvSpec] = {}
#: "pending" until the first lookup, "loading" while that lookup runs the entry points, then "loaded"
_plugins_state = "pending"
#: reentrant: a plugin that looks ids up while it loads must not wait on itself
_plugins_lock = threading.RLock()
#: namespace -> (entry point, the keyword that takes the name after the slash), for ids built on first lookup
namespaces: dict[str, tuple[str | Callable[..., Env], str]] = {}
#: ids each imported file or module registered, so importing it again (a no-op) still finds them
_source_ids: dict[str, set[str]] = {}


class UnknownEnvError(gymnasium.error.Error, LookupError):
    """No env is registered under the requested id."""


class EnvArgumentError(gymnasium.error.Error, TypeError):
    """An env was made with a keyword its constructor does not take."""


class EnvTargetError(UnknownEnvError):
    """An env target (a file, a module, `source:NAME`) does not lead to the env(s) asked for."""


def register(
    id: str,
    entry_point: str | Callable[..., Env],
    *,
    max_episode_steps: int | None = None,
    nondeterministic: bool = False,
    **kwargs: Any,
) -> EnvSpec:
    """Registers `entry_point` (a class, factory or "module:attr") under `id`; `kwargs` are defaults."""
    parse_env_id(id)  # raises gymnasium's error naming the malformed part
    spec = EnvSpec(
        id=id,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        nondeterministic=nondeterministic,
        kwargs=dict(kwargs),
    )
    if id in registry and not _same_spec(registry[id], spec):  # the same registration again changes nothing
        logger.warning("re-registering %s: the new entry point replaces the old one", id)
    registry[id] = spec
    gymnasium.registry[id] = spec
    return spec


def register_namespace(namespace: str, entry_point: str | Callable[..., Env], keyword: str) -> None:
    """Every id `namespace/NAME` not registered otherwise is `entry_point` made with `keyword=NAME`.

    The id is registered when it is first looked up, so `list_envs` shows the ones in use, not every game of an
    ecosystem; NAME is checked by the env when it is made (it knows its ecosystem's names)."""
    if not namespace or "/" in namespace:
        raise ValueError(f"a namespace is one path segment without '/', got {namespace!r}")
    namespaces[namespace] = (entry_point, keyword)


def _build_from_namespace(id: str) -> EnvSpec | None:
    """Registers `id` from its namespace (see `register_namespace`); None when no namespace claims it."""
    namespace, slash, name = id.partition("/")
    if not slash or not name or namespace not in namespaces:
        return None
    entry_point, keyword = namespaces[namespace]
    defaults: dict[str, Any] = {keyword: name}
    return register(id, entry_point, **defaults)


def _same_spec(old: EnvSpec, new: EnvSpec) -> bool:
    """Whether `new` repeats `old` (a module imported twice, an install whose stale metadata still lists the
    bundled envs' old entry point), so re-registering it is silent: only a real replacement is worth a warning."""
    try:
        return bool(old == new)
    except Exception:  # kwargs whose == is not a bool (arrays): call them different
        return False


def _changed_ids(before: dict[str, EnvSpec]) -> list[str]:
    """Ids registered (or re-registered) since `before` was copied from the registry."""
    return sorted(i for i, s in registry.items() if before.get(i) is not s)


def _load_plugin(ep: importlib.metadata.EntryPoint) -> None:
    """Loads one entry point; one that registers nothing is named in a warning rather than passing silently."""
    dist = getattr(ep.dist, "name", None) or "an unknown distribution"
    where = f"env plugin `{ep.name} = {ep.value}` (from {dist})"
    before = dict(registry)
    try:
        loaded = ep.load()
        if callable(loaded) and not inspect.isclass(loaded):  # a class is an env, not a register function
            loaded()
    except Exception as err:  # one broken plugin must not hide every other env
        logger.warning("could not load %s: %s: %s", where, type(err).__name__, err)
        return
    if _changed_ids(before):
        return
    if inspect.isclass(loaded):
        why = (f"it names the class {loaded.__qualname__}, not a register function, so relax_gym did not call it; "
               "point the entry point at a function that calls relax_gym.register(id, cls)")
    elif not callable(loaded):
        why = f"it names a {type(loaded).__name__}, not a function that calls relax_gym.register(...)"
    else:
        why = "calling it did not call relax_gym.register(...)"
    logger.warning("%s registered no env: %s", where, why)


def _load_plugins() -> None:
    """Registers the ids of third-party packages' entry points, once, on the first lookup rather than at import."""
    global _plugins_state
    if _plugins_state == "loaded":
        return
    with _plugins_lock:  # a second thread waits here until the first has loaded them all
        if _plugins_state != "pending":  # loaded meanwhile, or this thread's plugin is looking ids up
            return
        _plugins_state = "loading"
        try:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                _load_plugin(ep)
        finally:  # once, even if listing the entry points failed: a lookup must not retry on every call
            _plugins_state = "loaded"


def spec(id: str) -> EnvSpec:
    """The registration of `id`; an unknown id names the closest registered ones."""
    _load_plugins()
    found = registry.get(id) or _build_from_namespace(id)
    if found is None:
        close = difflib.get_close_matches(id, list(registry), n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownEnvError(f"no env registered as {id!r}.{hint} `relax-gym envs` lists them all.")
    return found


def list_envs() -> list[str]:
    """Every registered id, sorted; the first call loads the plugins."""
    _load_plugins()
    return sorted(registry)


def env_class(id: str) -> Callable[..., Env]:
    entry = spec(id).entry_point
    return load_env_creator(entry) if isinstance(entry, str) else entry  # type: ignore[return-value]


def check_kwargs(id: str, creator: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raises EnvArgumentError naming a keyword `creator` does not take, before anything is built."""
    try:
        params = inspect.signature(creator).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: let the call itself tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise EnvArgumentError(
                f"{id} got an unexpected argument {key!r}.{hint} Valid arguments: {', '.join(valid) or 'none'}"
            )


def make(id: str, **kwargs: Any) -> Env:
    """Creates the env registered as `id`; `kwargs` override the registered defaults."""
    env_spec = spec(id)
    creator = env_class(id)
    merged = {**env_spec.kwargs, **kwargs}
    check_kwargs(id, creator, merged)
    env = creator(**merged)
    env.unwrapped.spec = dataclasses.replace(env_spec, kwargs=merged)
    return env


def describe(id: str) -> dict[str, Any]:
    """Modalities, tools and sandbox use declared by the env class, without creating it."""
    cls = env_class(id)
    meta = getattr(cls, "metadata", {}) or {}
    tools = tuple(meta.get("tools") or ()) or tuple(getattr(cls, "tool_names", ()))  # collected by Env subclassing
    entry = spec(id).entry_point
    where = entry if isinstance(entry, str) else f"{entry.__module__}:{getattr(entry, '__qualname__', entry)}"
    return {
        "id": id,
        "modalities": list(meta.get("modalities", ("text",))),
        "tools": list(tools),
        "sandbox": bool(meta.get("sandbox", False)),
        "entry_point": where,
        "description": (inspect.getdoc(cls) or "").split("\n")[0],
    }


# --- env targets: a file or module that registers ids, or `source:NAME` -------------------------------------------
def _is_module_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def split_env_target(target: str) -> tuple[str | None, str]:
    """(`source`, `NAME`) of `file.py[:NAME]` or `module[:NAME]`; (None, "") when `target` can only be an id."""
    _load_plugins()  # a plugin's id is an id, not a module to import
    source, colon, name = target.partition(":")
    if source.endswith(".py") or (colon and source and _is_module_name(source)):
        return source, name
    if not colon and target not in registry and _is_module_name(target):
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):  # a parent package is missing: then it is no module
            found = None
        if found is not None:
            return target, ""
    return None, ""


def _owned_ids(module_name: str) -> set[str]:
    """Ids whose entry point `module_name` defines: those it registered when it was imported before."""
    owned = set()
    for env_id, env_spec in registry.items():
        entry = env_spec.entry_point
        home = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", None)
        if home == module_name:
            owned.add(env_id)
    return owned


def _import_failed(source: str, err: BaseException) -> EnvTargetError:
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return EnvTargetError(f"importing {source} failed: {type(err).__name__}: {err}{at}")


def _import_file(source: str) -> tuple[str, ModuleType]:
    """Imports `source` (a .py path) once; a module already imported from that file is reused, not run again."""
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise EnvTargetError(f"no such file: {source}")
    key = str(path)
    name = path.stem
    present = sys.modules.get(name)
    present_file = getattr(present, "__file__", None)
    if present is not None and present_file and Path(present_file).resolve() == path:
        return key, present
    if present is not None or not name.isidentifier():  # never shadow another module (a file named json.py)
        name = f"_relax_gym_file_{name if name.isidentifier() else 'env'}_{hashlib.md5(key.encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return key, sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise EnvTargetError(f"{source} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look classes up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise _import_failed(source, err) from err
    return key, module


def import_env_source(source: str) -> tuple[ModuleType, list[str]]:
    """Imports a `path/to/file.py` or dotted module and returns it with the env ids it registers.

    The one place a target's file or module is imported, so `check`, `rollout`
    and `train` agree on what a file means. Importing twice runs it once; the
    ids are those it registered, plus those whose entry point it defines.
    """
    list_envs()  # plugins first, so their ids are not credited to `source`
    before = dict(registry)
    if source.endswith(".py"):
        key, module = _import_file(source)
    else:
        key = source
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as err:
            if err.name and source.startswith(err.name):
                raise EnvTargetError(f"no module named {source!r} (nor a registered id)") from err
            raise _import_failed(source, err) from err
        except Exception as err:
            raise _import_failed(source, err) from err
    recorded = _source_ids.setdefault(key, set())
    recorded.update(_changed_ids(before))
    return module, sorted(recorded | _owned_ids(module.__name__))


def resolve_env_id(target: str) -> str:
    """The registered id that `target` names, importing what it needs.

    `target` is an id; a `file.py` or `module` that registers exactly one id;
    or `file.py:NAME` / `module:NAME` where NAME is a registered id or the
    class registered under exactly one id. Anything else raises
    UnknownEnvError (EnvTargetError for files and modules) in one line.
    """
    if target in list_envs() or _build_from_namespace(target) is not None:
        return target
    source, name = split_env_target(target)
    if source is None:
        spec(target)  # raises UnknownEnvError naming the closest ids
    assert source is not None
    module, ids = import_env_source(source)
    if not name:
        if len(ids) == 1:
            return ids[0]
        if not ids:
            raise EnvTargetError(f"{source} registered no env: call relax_gym.register(id, EnvClass) in it")
        raise EnvTargetError(f"{source} registers {len(ids)} envs ({', '.join(ids)}): name one as {source}:ID")
    if name in registry:
        return name
    attr = getattr(module, name, None)
    if attr is None:
        listed = f"; it registers {', '.join(ids)}" if ids else ""
        raise EnvTargetError(f"{name!r} is neither a registered id nor defined in {source}{listed}")
    owners = sorted(
        i for i, s in registry.items() if s.entry_point is attr or s.entry_point == f"{module.__name__}:{name}"
    )
    if len(owners) == 1:
        return owners[0]
    if not owners:
        raise EnvTargetError(f"{source}:{name} is not registered: call relax_gym.register('ns/{name}-v0', {name}) "
                             "in it, or check it with `relax-gym check`, which takes classes")
    raise EnvTargetError(f"{name} is registered as {', '.join(owners)}: name one as {source}:ID")
