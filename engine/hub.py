"""`--model` as a Hugging Face hub id (`Qwen/Qwen3-30B-A3B`): resolved to a snapshot directory
once, when the server config is built (engine/config.py), so that every process gets a
directory and none of them talks to the hub.

Order: a local directory of that name wins; then the local HF cache (HF_HUB_CACHE, laid out
as the hub lays it out: models--Org--Name/refs/main -> snapshots/<commit>/, files linked
to blobs/); then a download when online. Offline (HF_HUB_OFFLINE=1, or no network) an id
that is not cached is an error naming the id and the cache directory. huggingface_hub reads
its environment once, at import.
"""

from __future__ import annotations

import re
from pathlib import Path

# weight formats Strata never reads: not downloaded (safetensors only; models/loader.py)
_NEVER_READ = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "original/*"]
# "name" or "org/name" (the hub's own rule for the characters); a path such as ./x, /x, ~/x or
# a/b/c is never an id
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(model: str) -> bool:
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.endswith(".")


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(model: str, load_format: str = "auto") -> str:
    """A directory for `--model`: `model` itself when it is a directory, else the snapshot
    directory of the hub id `model`. Raises ValueError naming `--model` when neither."""
    if Path(model).expanduser().is_dir():
        return model
    if not is_hub_id(model):
        raise ValueError(f"--model {model}: no such directory (and not a Hugging Face hub id)")
    dummy = load_format == "dummy"  # random weights: only the config and tokenizer are needed
    path = _cached(model, dummy) or _download(model, dummy)
    if not dummy and not any(Path(path).glob("*.safetensors")):  # offline, a snapshot cached for dummy
        raise ValueError(f"--model {model}: its snapshot {path} in the Hugging Face cache {cache_dir()} holds no "
                         "safetensors weights (offline or hub unreachable; --load-format dummy needs none)")
    return path


def _ignore(dummy: bool) -> list[str]:
    return _NEVER_READ + (["*.safetensors"] if dummy else [])


def _cached(model: str, dummy: bool) -> str | None:
    """The cached snapshot of refs/main, when it holds what this load format reads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(model, local_files_only=True, ignore_patterns=_ignore(dummy))
    except LocalEntryNotFoundError:
        return None
    if dummy or any(Path(path).glob("*.safetensors")):
        return path
    return None  # cached for --load-format dummy only (no weights): download them when online


def _download(model: str, dummy: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(model, ignore_patterns=_ignore(dummy))
    except LocalEntryNotFoundError as exc:  # offline, or the hub unreachable
        raise ValueError(
            f"--model {model}: not a directory, and the Hugging Face hub id is not in the cache "
            f"{cache_dir()} (offline or hub unreachable: {_first_line(exc)}). Download it while online, "
            "or set HF_HUB_CACHE to a cache that holds it"
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ValueError(f"--model {model}: not a directory, and the Hugging Face hub has no such model "
                         f"that this machine may read ({_first_line(exc)})") from exc


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
