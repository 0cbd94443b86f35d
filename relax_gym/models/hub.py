"""A model by its Hugging Face hub id (`ORG/NAME`, `ORG/NAME@REVISION`) as a local snapshot folder.

Through huggingface_hub's `snapshot_download`, as transformers' `from_pretrained(id)` resolves one: fetched into
its cache (`HF_HOME` / `HF_HUB_CACHE`) and read from there, offline (`HF_HUB_OFFLINE=1`) from the cache alone.
Only what `load_model` reads is fetched: configs, safetensors weights, tokenizer and processor files, chat
templates; no pickled `.bin` / `.pt` weights, GGUF or ONNX copies of the same model.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from relax_gym.errors import first_line

#: ORG/NAME as the hub spells repo ids, then an optional @REVISION (a branch, tag or commit)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
#: the files a checkpoint folder needs here (`relax_gym.models.loading`)
SNAPSHOT_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


class HubModelError(ValueError):
    """A hub id that resolves to no snapshot here; the message names the repo, the cache and the fixes (the
    caller names the model)."""


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `name` is spelled as a hub id, else None."""
    match = HUB_ID.fullmatch(name)
    return (match["repo"], match["revision"]) if match else None


def hub_snapshot(name: str) -> Path:
    """The local snapshot folder of the hub id `name`, downloading what is missing unless offline.

    Raises `HubModelError` when it cannot: not cached and offline, the hub unreachable, no such repo or
    revision, or a gated repo without a token."""
    parsed = parse_hub_id(name)
    if parsed is None:
        raise HubModelError(f"{name!r} is not spelled as one (ORG/NAME or ORG/NAME@REVISION)")
    repo, revision = parsed
    cache = constants.HF_HUB_CACHE
    fixes = (f"download it where the hub is reachable (`hf download {repo}"
             f"{f' --revision {revision}' if revision else ''}`, into the same cache) or pass a local checkpoint "
             "folder")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(SNAPSHOT_FILES)))
    except GatedRepoError:
        why = f"{repo} is gated on the hub: accept its terms there and log in (`hf auth login`, or HF_TOKEN)"
    except RevisionNotFoundError:
        why = f"{repo} has no revision {revision!r} on the hub"
    except RepositoryNotFoundError:
        why = f"{repo} is not a repo on the hub (or a private one this token cannot read)"
    except LocalEntryNotFoundError as err:
        cause = err.__cause__ or err.__context__
        reached = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else (
            f"the hub could not be reached ({type(cause).__name__}: {first_line(cause, 120)})"
            if cause is not None else "the hub could not be reached")
        where = f"revision {revision!r} of {repo}" if revision else repo
        why = f"{where} is not in the Hugging Face cache at {cache} and {reached}: {fixes}"
    except (OSError, ValueError) as err:  # a disk error writing the cache, a malformed revision
        why = f"{repo} could not be fetched into {cache}: {type(err).__name__}: {first_line(err, 200)}"
    raise HubModelError(why)
