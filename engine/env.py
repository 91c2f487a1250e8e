"""Environment variables, read once into a typed, frozen record.

Every STRATA_* variable the code honours is declared here; nothing else calls os.getenv. Kernel
choices are not environment variables: they come from the GPU's tuning file
(engine/layers/tuning.py, configs/tuning/) and `--decode-kernel`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Env:
    cache_dir: Path  # STRATA_CACHE_DIR: converted models and other reusable artifacts
    log_level: str  # STRATA_LOG_LEVEL
    log_json: bool | None  # STRATA_LOG_JSON: force JSON (1) or console (0) on stderr
    digest_every: int  # STRATA_DIGEST_EVERY: steps between DigestCheck ops (0 = never)
    git_commit: str | None  # STRATA_GIT_COMMIT: recorded in benchmark results run outside a checkout
    # STRATA_PROFILE_STEPS=FIRST[:COUNT] (COUNT 100 if left out): torch-profile a worker's forward steps
    profile_steps: tuple[int, int] | None
    api_key: str | None = None  # STRATA_API_KEY: bin/serve's --api-key when the flag is not given

    def __post_init__(self) -> None:
        if self.digest_every < 0:
            raise ValueError(f"STRATA_DIGEST_EVERY must be >= 0 (0 = never), got {self.digest_every}")
        if self.log_level not in ("debug", "info", "warning", "warn", "error", "critical"):
            raise ValueError(f"STRATA_LOG_LEVEL must be debug, info, warning, error or critical: {self.log_level!r}")


# Set in every process we start and in every rank that joins a process group: NVLink multicast
# stays off on the lent GPU machines, NVSHMEM's switch too should torch's symmetric memory ever
# pick that backend (docs/architecture.md, "Tensor parallelism")
DIST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _flag(name: str) -> bool | None:
    val = os.environ.get(name)
    if val is None or val == "":
        return None
    if val.lower() in ("1", "true", "yes"):
        return True
    if val.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 1/true/yes or 0/false/no, got {val!r}")


def _steps(name: str) -> tuple[int, int] | None:
    """FIRST[:COUNT], both >= 1 (checked here, at start: a bad one failed in a worker after it loaded)."""
    val = os.environ.get(name)
    if not val:
        return None
    first, _, count = val.partition(":")
    try:
        window = int(first), int(count or 100)
    except ValueError:
        window = (0, 0)
    if min(window) < 1:
        raise ValueError(f"{name} must be FIRST:COUNT, both integers >= 1, got {val!r}")
    return window


def _int(name: str, default: int) -> int:
    val = os.environ.get(name)
    try:
        return default if val is None else int(val)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {val!r}") from None


@cache
def env() -> Env:
    base = os.environ.get("STRATA_CACHE_DIR") or str(Path.home() / ".cache" / "strata")
    return Env(
        cache_dir=Path(base),
        log_level=os.environ.get("STRATA_LOG_LEVEL", "info").lower(),
        log_json=_flag("STRATA_LOG_JSON"),
        digest_every=_int("STRATA_DIGEST_EVERY", 64),
        git_commit=os.environ.get("STRATA_GIT_COMMIT") or None,
        profile_steps=_steps("STRATA_PROFILE_STEPS"),
        api_key=os.environ.get("STRATA_API_KEY") or None,
    )
