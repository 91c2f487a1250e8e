"""Environment variables, read once into a typed, frozen record.

Every STRATA_* variable the code honours is declared here; nothing else calls os.getenv.
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
    flashinfer_prefill_backend: str  # STRATA_FLASHINFER_PREFILL_BACKEND: fa2 (default) | fa3 | auto
    git_commit: str | None  # STRATA_GIT_COMMIT: recorded in benchmark results run outside a checkout
    decode_kernel: str  # STRATA_DECODE_KERNEL: auto (the fastest measured per batch) | fa2 | xqa | triton
    fused_prologue: bool  # STRATA_FUSED_PROLOGUE: one triton kernel for q/k norm + RoPE + KV store (1)
    triton_gemv: bool  # STRATA_TRITON_GEMV: batch-1 projections as triton GEMVs, not cuBLAS (1)
    gemv_max_rows: int  # STRATA_GEMV_MAX_ROWS: most rows a one-tile triton GEMV takes (4, measured; <= 8)
    gemv_tune: str | None  # STRATA_GEMV_TUNE: JSON {"N,K": [block_n, block_k, warps, stages]} overrides
    triton_pdl: bool  # STRATA_TRITON_PDL: triton kernels use programmatic dependent launch (1)
    norm_gemv: bool  # STRATA_NORM_GEMV: batch 1, fold add + RMSNorm into the next GEMV (1)
    xqa_pdl: bool  # STRATA_XQA_PDL: launch XQA with programmatic dependent launch (0: measured slower)


def _flag(name: str) -> bool | None:
    val = os.environ.get(name)
    return None if val is None else val.lower() in ("1", "true", "yes")


@cache
def env() -> Env:
    base = os.environ.get("STRATA_CACHE_DIR") or str(Path.home() / ".cache" / "strata")
    e = _read(base)
    if e.gemv_max_rows < 1:
        raise ValueError(f"STRATA_GEMV_MAX_ROWS must be >= 1, got {e.gemv_max_rows}")
    return e


def _read(base: str) -> Env:
    return Env(
        cache_dir=Path(base),
        log_level=os.environ.get("STRATA_LOG_LEVEL", "info").lower(),
        log_json=_flag("STRATA_LOG_JSON"),
        digest_every=int(os.environ.get("STRATA_DIGEST_EVERY", "64")),
        flashinfer_prefill_backend=os.environ.get("STRATA_FLASHINFER_PREFILL_BACKEND", "fa2"),
        git_commit=os.environ.get("STRATA_GIT_COMMIT") or None,
        decode_kernel=os.environ.get("STRATA_DECODE_KERNEL", "auto").lower(),
        fused_prologue=_flag("STRATA_FUSED_PROLOGUE") is not False,
        triton_gemv=_flag("STRATA_TRITON_GEMV") is not False,
        gemv_max_rows=int(os.environ.get("STRATA_GEMV_MAX_ROWS", "4")),
        gemv_tune=os.environ.get("STRATA_GEMV_TUNE") or None,
        triton_pdl=_flag("STRATA_TRITON_PDL") is not False,
        norm_gemv=_flag("STRATA_NORM_GEMV") is not False,
        xqa_pdl=bool(_flag("STRATA_XQA_PDL")),
    )
