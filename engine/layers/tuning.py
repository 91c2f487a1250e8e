"""Kernel choices per GPU model: one checked-in JSON file per model under configs/tuning/.

The file is chosen by the CUDA device's name ("NVIDIA H200" -> configs/tuning/NVIDIA_H200.json).
Its values are the winners of the A/Bs recorded in docs/PERF.md, measured on that GPU; a GPU
without a file gets `KernelTuning()`'s defaults, which use only the vendor kernels (flashinfer's
FA2/XQA attention, its norm and rotary kernels, cuBLAS projections): our triton kernels are
fast on the GPU they were measured on, but are only turned on where someone measured them.

`--decode-kernel` (ServerConfig.decode_kernel) overrides the decode rule for debugging; nothing
here reads the environment. `override_tuning` replaces fields in one process, for the benches'
A/Bs (scripts/tp_bench.py runs each variant in its own processes); served runs never call it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

TUNING_DIR = Path(__file__).resolve().parents[2] / "configs" / "tuning"
DECODE_KERNELS = ("fa2", "xqa", "triton")


@dataclass(frozen=True)
class DecodeRule:
    """Use `kernel` for decode batches up to `max_batch` (None: any size) where it is supported."""

    kernel: str
    max_batch: int | None = None


@dataclass(frozen=True)
class GemvRule:
    """A GEMV config (block_n, block_k, warps, stages) for weights [N, K] with min_n <= N <= max_n
    (None: unbounded) and K a multiple of block_k; with `k`, for that K only, and then before the
    one-tile rule (a shape measured on its own)."""

    config: tuple[int, int, int, int]
    min_n: int | None = None
    max_n: int | None = None
    k: int | None = None

    def takes(self, n: int, k: int) -> bool:
        """Whether the rule's N bounds and K take [n, k] (a rule without `k` also needs whole K tiles)."""
        in_n = (self.min_n is None or n >= self.min_n) and (self.max_n is None or n <= self.max_n)
        return in_n and (k == self.k if self.k is not None else k % self.config[1] == 0)


@dataclass(frozen=True)
class Fp8GemmRule:
    """The triton row-scaled fp8 GEMM's tiles (block_m, block_n, block_k, warps, stages) for x of
    at most `max_rows` rows times weights [N, K] with min_n <= N <= max_n (None: unbounded)."""

    config: tuple[int, int, int, int, int]
    max_rows: int
    min_n: int | None = None
    max_n: int | None = None


@dataclass(frozen=True)
class MoeRule:
    """Fused MoE GEMM blocks (block_m, block_n, block_k, group_m, warps, stages) where the experts
    that got tokens get at most `max_rows` (token, expert) pairs each on average (None: any)."""

    config: tuple[int, int, int, int, int, int]
    max_rows: int | None = None


# engine/layers/moe_kernels.py's blocks, not measured on our kernels yet: a BLOCK_M near an
# expert's rows (decode: a few pairs per expert, so 16), wider tiles as the experts get more rows
# (prefill); the steps follow where published H200 fused-MoE tunings move to the next BLOCK_M
MOE_GEMM_DEFAULT = (
    MoeRule((16, 64, 128, 1, 4, 4), 12), MoeRule((32, 128, 64, 1, 4, 3), 24),
    MoeRule((64, 128, 64, 16, 8, 3), 64), MoeRule((128, 128, 64, 16, 8, 3)),
)


@dataclass(frozen=True)
class KernelTuning:
    """Which kernel runs where. The defaults are the safe choice for a GPU nobody measured."""

    gpu: str = "default"  # the device name this was chosen for, or "default"
    # decode attention per KV dtype: the first rule whose kernel is supported and whose
    # max_batch covers the (padded) batch wins; FA2 when none does
    decode_bf16: tuple[DecodeRule, ...] = (DecodeRule("fa2"),)
    decode_fp8: tuple[DecodeRule, ...] = (DecodeRule("xqa"), DecodeRule("fa2"))
    triton_pdl: bool = False  # triton kernels launch with programmatic dependent launch (SM90+)
    fused_prologue: bool = False  # q/k norm + RoPE + K/V store as one triton launch per layer
    triton_gemv: bool = False  # small-batch projections as triton GEMVs instead of cuBLAS
    gemv_max_rows: int = 1  # most rows of x a one-tile GEMV takes (small decode batches)
    gemv_one_tile_below_k: int = 0  # K below which a GEMV program takes its rows' whole K as one tile
    gemv_one_tile_elems: int = 8192  # elements of weight per one-tile program (block_n * padded K)
    gemv_looped: tuple[GemvRule, ...] = field(default=())  # configs for wider K, first match wins
    norm_gemv_max_hidden: int = 0  # fold residual add + RMSNorm into the next GEMV up to this hidden size
    # fp8 weights (engine/layers/quant.py): the GEMV's configs (empty: gemv_looped's), the most rows
    # the weight-only fp8 GEMM takes (0: none), and from how many rows block-scaled fp8 runs on
    # cuBLASLt instead of the triton kernel (0: never)
    gemv_fp8_looped: tuple[GemvRule, ...] = field(default=())
    fp8_weight_only_max_rows: int = 0
    fp8_block_cublas_min_rows: int = 0
    # ... and from how many rows on DeepGEMM where `deep_gemm` imports (0: never; before cuBLASLt's rule)
    fp8_block_deepgemm_min_rows: int = 0
    # row-scaled fp8 above the weight-only rows: the triton GEMM where a rule takes (rows, N), first
    # match wins; cuBLASLt otherwise
    fp8_row_triton: tuple[Fp8GemmRule, ...] = field(default=())
    # tensor parallel: all-reduces of at most this many bytes (bf16/fp32, CUDA) take the one-shot
    # all-reduce over peer memory (torch symmetric memory: one kernel, capturable in a CUDA graph);
    # larger ones, and all of them at 0, take NCCL (engine/layers/parallel.py, SymmAllReduce)
    tp_symm_allreduce_max_bytes: int = 0
    # fused MoE (engine/layers/moe_kernels.py): GEMM blocks by the mean rows an expert gets, first match wins
    moe_gemm: tuple[MoeRule, ...] = MOE_GEMM_DEFAULT
    # one token's routed experts as two GEMV launches (engine/layers/moe_gemv.py): (block_n over w13,
    # block_k over w13, block_n over w2, block_k over w2, warps); None: the fused path at one token too
    moe_gemv: tuple[int, int, int, int, int] | None = None
    invariant_gemm_pdl: bool = False  # deterministic inference's GEMM (invariant_gemm.py) launches with PDL
    # deterministic inference's GEMV (1-8 rows) as CUDA C++ (invariant_gemv.cu) instead of the triton one
    invariant_gemv_cuda: bool = False
    # deterministic inference's residual-stream RMSNorms folded into the GEMMs around them (the CUDA GEMV's
    # and the invariant GEMM's epilogues; models/llama.py fold_norms) for models up to this hidden size: no
    # norm launch in a layer; per model, so the same arithmetic at every row count (H100: hidden 1,024 and
    # 2,048 win, 4,096 loses)
    det_norm_fold_max_hidden: int = 0
    # MLA decode (engine/layers/mla_attention.py): flashinfer's MLA wrapper (engine/layers/flashinfer_mla.py)
    # on ranks with at least this many query heads, where it takes the geometry; our triton kernel
    # (engine/layers/mla_kernels.py) below that, and on every rank at 0 (a GPU nobody measured)
    mla_flashinfer_min_heads: int = 0
    # FlashMLA's dense SM90 decode (engine/layers/flash_mla.py) on every MLA rank it takes (bf16, 64-token
    # pages), before the two above
    mla_flashmla: bool = False

    def decode_kernel(self, override: str, xqa_ok: bool, triton_ok: bool, kv_dtype: torch.dtype, batch: int) -> str:
        """The decode kernel for a batch of this (padded) size: "fa2", "xqa" or "triton".
        `override` ("auto" or a kernel name, from --decode-kernel) names one, used where
        supported (else fa2); "auto" follows this GPU's rules."""
        ok = {"fa2": True, "xqa": xqa_ok, "triton": triton_ok}
        if override != "auto":
            if override not in DECODE_KERNELS:
                names = ", ".join(DECODE_KERNELS)
                raise ValueError(f"--decode-kernel must be auto or one of {names}, got {override!r}")
            return override if ok[override] else "fa2"
        rules = self.decode_fp8 if kv_dtype.itemsize == 1 else self.decode_bf16
        for r in rules:
            if ok[r.kernel] and (r.max_batch is None or batch <= r.max_batch):
                return r.kernel
        return "fa2"

    def max_decode_batch(self, kernel: str, kv_dtype: torch.dtype) -> int | None:
        """The largest batch "auto" may give `kernel` (None: any size; 0: never)."""
        rules = self.decode_fp8 if kv_dtype.itemsize == 1 else self.decode_bf16
        sizes = [r.max_batch for r in rules if r.kernel == kernel]
        if not sizes:
            return 0
        return None if None in sizes else max(s for s in sizes if s is not None)

    def mla_decode_kernel(self, heads: int, flashinfer_ok: bool, flashmla_ok: bool = False) -> str:
        """The MLA decode kernel of a rank with `heads` query heads: "flashmla" (where `flashmla_ok`:
        it takes the rank's dtypes, latent and page size), "flashinfer" (where `flashinfer_ok`) or
        "triton"."""
        if flashmla_ok and self.mla_flashmla:
            return "flashmla"
        if flashinfer_ok and 0 < self.mla_flashinfer_min_heads <= heads:
            return "flashinfer"
        return "triton"

    def moe_config(self, rows: int) -> tuple[int, int, int, int, int, int]:
        """The fused MoE GEMM blocks for experts getting `rows` pairs each on average."""
        for r in self.moe_gemm:
            if r.max_rows is None or rows <= r.max_rows:
                return r.config
        return self.moe_gemm[-1].config

    def gemv_rows(self, cfg: tuple[int, int, int, int] | None) -> int:
        """The most rows of x a GEMV with config cfg takes: gemv_max_rows for tiles of at most
        gemv_one_tile_elems (what the rows were measured with), one for wider ones (Llama-3.1-8B's fp8
        gate_up as one 4 x 4096 tile: batch 1 2.82 -> 2.70 ms, but batch 4 4.69 -> 5.59 with 4 rows a
        program; bench/results/latency-llama-3.1-8b-fp8w-rows-*-h200-ee1ec3a.json)."""
        return self.gemv_max_rows if cfg is not None and cfg[0] * cfg[1] <= self.gemv_one_tile_elems else 1

    def gemv_config(self, n: int, k: int, fp8: bool = False) -> tuple[int, int, int, int] | None:
        """(block_n, block_k, warps, stages) of the triton GEMV for weights [n, k] (e4m3 with `fp8`),
        or None (cuBLAS)."""
        if not self.triton_gemv:
            return None
        rules = (self.gemv_fp8_looped or self.gemv_looped) if fp8 else self.gemv_looped
        for r in rules:  # a rule for this K first (triton_ops.gemv_config checks its tile fits K)
            if r.k is not None and r.takes(n, k):
                return r.config
        if k < self.gemv_one_tile_below_k and k % 64 == 0:
            kp2 = 1 << (k - 1).bit_length()
            return (max(4, self.gemv_one_tile_elems // kp2), kp2, 4, 1)
        return next((r.config for r in rules if r.k is None and r.takes(n, k)), None)

    def fp8_row_config(self, rows: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
        """The triton row-scaled fp8 GEMM's tiles for x [rows, k] times weights [n, k], or None
        (cuBLASLt)."""
        for r in self.fp8_row_triton:
            if (rows <= r.max_rows and (r.min_n is None or n >= r.min_n) and (r.max_n is None or n <= r.max_n)
                    and k % r.config[2] == 0):
                return r.config
        return None


def tuning_file(device_name: str) -> Path:
    """configs/tuning/<device name, non-alphanumerics as _>.json"""
    return TUNING_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def parse_tuning(data: dict, gpu: str) -> KernelTuning:
    """A KernelTuning from a tuning file's JSON; unknown keys are an error (a typo must not
    silently fall back to a default). Keys starting with "_" are comments."""
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    names = {f.name for f in dataclasses.fields(KernelTuning)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"tuning for {gpu}: unknown keys {unknown}")
    kw: dict = dict(data, gpu=gpu)
    for key in ("decode_bf16", "decode_fp8"):
        if key in kw:
            kw[key] = tuple(DecodeRule(**r) for r in kw[key])
            bad = [r.kernel for r in kw[key] if r.kernel not in DECODE_KERNELS]
            if bad:
                raise ValueError(f"tuning for {gpu}: {key} names unknown kernels {bad}")
    for key in ("gemv_looped", "gemv_fp8_looped"):
        if key in kw:
            kw[key] = tuple(GemvRule(**{**r, "config": tuple(r["config"])}) for r in kw[key])
    if "fp8_row_triton" in kw:
        kw["fp8_row_triton"] = tuple(Fp8GemmRule(**{**r, "config": tuple(r["config"])}) for r in kw["fp8_row_triton"])
        if any(len(r.config) != 5 or min(r.config) < 1 for r in kw["fp8_row_triton"]):
            raise ValueError(f"tuning for {gpu}: fp8_row_triton needs rules of 5 positive tile values")
    if "moe_gemm" in kw:
        kw["moe_gemm"] = tuple(MoeRule(**{**r, "config": tuple(r["config"])}) for r in kw["moe_gemm"])
    if kw.get("moe_gemv") is not None:
        kw["moe_gemv"] = tuple(kw["moe_gemv"])
        if len(kw["moe_gemv"]) != 5 or min(kw["moe_gemv"]) < 1:
            raise ValueError(f"tuning for {gpu}: moe_gemv needs 5 positive values or null")
    t = KernelTuning(**kw)
    if not t.moe_gemm or any(len(r.config) != 6 or min(r.config) < 1 for r in t.moe_gemm):
        raise ValueError(f"tuning for {gpu}: moe_gemm needs rules of 6 positive block values")
    if not 1 <= t.gemv_max_rows <= 8:  # the GEMV kernel's unrolled row loop takes at most 8
        raise ValueError(f"tuning for {gpu}: gemv_max_rows must be in 1..8, got {t.gemv_max_rows}")
    if t.tp_symm_allreduce_max_bytes < 0:
        raise ValueError(f"tuning for {gpu}: tp_symm_allreduce_max_bytes must be >= 0")
    if not isinstance(t.mla_flashinfer_min_heads, int) or t.mla_flashinfer_min_heads < 0:
        raise ValueError(f"tuning for {gpu}: mla_flashinfer_min_heads must be an integer >= 0 (0: never), "
                         f"got {t.mla_flashinfer_min_heads!r}")
    if not isinstance(t.mla_flashmla, bool):
        raise ValueError(f"tuning for {gpu}: mla_flashmla must be true or false, got {t.mla_flashmla!r}")
    return t


_OVERRIDE: dict = {}  # override_tuning's fields, applied over every CUDA device's file


def load_tuning(device_name: str) -> KernelTuning:
    """The tuning file for this GPU model (with override_tuning's fields over it), or the safe
    defaults when there is neither."""
    path = tuning_file(device_name)
    if not path.is_file() and not _OVERRIDE:
        return DEFAULT
    data = json.loads(path.read_text()) if path.is_file() else {}
    return parse_tuning(data | _OVERRIDE, device_name)


def override_tuning(**fields: object) -> None:
    """Replace these KernelTuning fields (JSON values, as in a tuning file) of every CUDA
    device's tuning in this process, or drop all replacements when called with none. For
    benchmarks' A/Bs, before the model is built (layers read the tuning once); unknown names are
    an error, as in a file."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(KernelTuning)} - {"gpu"})
    if unknown or "gpu" in fields:
        raise ValueError(f"override_tuning: unknown fields {unknown or ['gpu']}")
    _OVERRIDE.clear()
    _OVERRIDE.update(fields)
    _for_cuda_index.cache_clear()


DEFAULT = KernelTuning()


@functools.cache
def _for_cuda_index(index: int) -> KernelTuning:
    return load_tuning(torch.cuda.get_device_name(index))


def kernel_tuning(device: torch.device) -> KernelTuning:
    """The tuning of this device (read once per device); the defaults off CUDA, where none of
    these kernels run."""
    if device.type != "cuda":
        return DEFAULT
    return _for_cuda_index(device.index if device.index is not None else torch.cuda.current_device())
