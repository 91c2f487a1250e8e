"""Compile triton kernels for an H200 (sm_90a) on a machine without a GPU, before they cost device time.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a kernel that reads a
module global which is not a `tl.constexpr`, or that the compiler otherwise refuses, passes every
CPU test and fails at its first GPU launch (twenty-second session, docs/PERF.md). Here each case
calls an op of engine/layers on CPU tensors at a model's shapes with the launches recorded instead
of run, then compiles every recorded launch with `triton.compile` for the H200's target, its
arguments specialized as triton's launcher does, and prints its registers and spilled bytes a
thread (triton's bundled cuobjdump). A kernel's PDL switch is on wherever it has one (on CPU
tensors the ops turn it off; on the H200 the batch-1 launches have it on, the fused MoE path's
launches at more tokens off). The registers come from this machine's triton, which need not be
the GPU machine's version (pass PYTHONPATH to another triton to compare).

    python scripts/compile_check.py                  # every case
    python scripts/compile_check.py decode-a3b moe-a3b
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: the interpreter's are not JITFunctions

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.layers.tuning import load_tuning  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # launch kwargs that are compile options


@contextmanager
def recorded() -> Iterator[list[tuple[JITFunction, tuple, dict]]]:
    """Every `kernel[grid](...)` launch in the block recorded as (kernel, args, kwargs), none run."""
    launches: list[tuple[JITFunction, tuple, dict]] = []
    launch = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: launches.append((self, a, k))  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = launch  # type: ignore[method-assign]


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict,
                   target: GPUTarget = H200) -> triton.compiler.CompiledKernel:
    """The recorded launch compiled for `target` as triton's launcher would compile it (its own
    argument specialization: 16-byte aligned pointers and multiples of 16 marked divisible, ints
    equal to 1 made constants), with PDL on where the kernel has the constexpr."""
    bound = dict(zip(fn.arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int], object] = {}
    attrs: dict[tuple[int], list] = {}
    for i, p in enumerate(fn.params):
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            ty = "constexpr"
            value = True if p.name == "PDL" and target.backend == "cuda" else value
        else:
            ty, spec = native_specialize_impl(BaseBackend, value, p.is_const, not p.do_not_specialize,
                                              not p.do_not_specialize_on_alignment)
            if isinstance(spec, str):
                attrs[(i,)] = BaseBackend.parse_attr(spec)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = value
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def resources(kernel: triton.compiler.CompiledKernel) -> tuple[int, int]:
    """(registers, stack bytes) a thread of a compiled kernel's cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {out[:200]}")
    return int(m[1]), int(m[2])


def _decode(hq: int, hkv: int, norm: bool) -> Callable[[], None]:
    """triton_ops.decode_attention at batch 1, ctx 1024, with its prologue (RoPE, optional q/k norm)."""

    def case() -> None:
        from engine.layers import triton_ops

        d, ps, ctx = 128, 16, 1024
        kc = torch.empty(ctx // ps * ps, hkv, d, dtype=torch.bfloat16)
        ws = triton_ops.decode_workspace(1, hkv, d, 132, torch.device("cpu"))
        w = torch.ones(d, dtype=torch.bfloat16) if norm else None
        splits = triton_ops.decode_splits(1, hkv, 132)
        triton_ops.decode_attention(
            torch.empty(1, (hq + 2 * hkv) * d, dtype=torch.bfloat16), hq, hkv, d, torch.tensor([ctx - 1]),
            torch.zeros(1, ctx // ps, dtype=torch.int32), kc, kc, ps, ws, splits,
            torch.empty(4096, d, dtype=torch.float32), w, w, parts=triton_ops.decode_parts(1, hq, hkv, splits, 132))

    return case


def _moe_one_token(h: int, e: int, k: int, inter: int) -> Callable[[], None]:
    """moe_gemv.one_token_experts at the H200 tuning file's blocks (the weights untouched memory)."""

    def case() -> None:
        from engine.layers import moe_kernels as mk
        from engine.layers.moe_gemv import GemvConfig, one_token_experts

        w13 = mk.Stack(torch.empty(e, 2 * inter, h, dtype=torch.bfloat16), None, None)
        w2 = mk.Stack(torch.empty(e, h, inter, dtype=torch.bfloat16), None, None)
        cfg = GemvConfig(*load_tuning("NVIDIA H200").moe_gemv)
        one_token_experts(torch.empty(1, h, dtype=torch.bfloat16), torch.ones(1, k), torch.arange(k).view(1, k),
                          w13, w2, torch.zeros(e, dtype=torch.int64), 0, cfg)

    return case


def _moe_fused(h: int, e: int, k: int, inter: int, tokens: int) -> Callable[[], None]:
    """moe_kernels' routing and fused path (align, w13 and w2 GEMMs, combine) for `tokens` tokens at the
    H200 file's GEMM blocks, and the router's add + norm GEMV of one token (MoE.add_norm_forward)."""

    def case() -> None:
        from types import SimpleNamespace

        from engine.layers import moe_kernels as mk
        from engine.layers import triton_ops

        tuning = load_tuning("NVIDIA H200")
        spec = SimpleNamespace(top_k=k, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
                               norm_topk_prob=True, routed_scaling_factor=1.0, num_experts=e)
        weights, ids = mk.route(torch.empty(tokens, e, dtype=torch.bfloat16), spec, None)
        ids = torch.arange(tokens * k).view(tokens, k) % e  # route's outputs are not computed here
        cfg = mk.GemmConfig(*tuning.moe_config(-(-tokens * k // min(tokens * k, e))))
        w13 = mk.Stack(torch.empty(e, 2 * inter, h, dtype=torch.bfloat16), None, None)
        w2 = mk.Stack(torch.empty(e, h, inter, dtype=torch.bfloat16), None, None)
        mk.fused_experts(torch.empty(tokens, h, dtype=torch.bfloat16), weights, ids, w13, w2,
                         torch.zeros(e, dtype=torch.int64), 0, cfg)
        router = torch.empty(e, h, dtype=torch.bfloat16)
        x = torch.empty(1, h, dtype=torch.bfloat16)
        triton_ops.add_norm_gemv(x, torch.empty_like(x), torch.ones(h, dtype=torch.bfloat16), 1e-6, router,
                                 *tuning.gemv_config(e, h), h_out=True)

    return case


def _gemvs(shapes: list[tuple[int, int]], fp8: bool = False, silu_last: bool = True) -> Callable[[], None]:
    """triton_ops.gemv at batch 1 over weights [n, k] at the H200 file's config for each (the last one
    with SiLU-and-mul folded in, as the down projection runs)."""

    def case() -> None:
        from engine.layers import triton_ops

        tuning = load_tuning("NVIDIA H200")
        for i, (n, k) in enumerate(shapes):
            cfg = tuning.gemv_config(n, k, fp8=fp8)
            if cfg is None:
                raise RuntimeError(f"the H200 file takes no triton GEMV for [{n}, {k}]")
            silu = silu_last and i == len(shapes) - 1
            w = torch.empty(n, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
            triton_ops.gemv(torch.empty(1, 2 * k if silu else k, dtype=torch.bfloat16), w, *cfg, silu_mul=silu,
                            scale=torch.ones(n) if fp8 else None)

    return case


def _invariant(rows: int, shapes: list[tuple[int, int]]) -> Callable[[], None]:
    """invariant_gemm.gemm (deterministic inference) at `rows` rows over weights [n, k], its tiles."""

    def case() -> None:
        from engine.layers import invariant_gemm

        for n, k in shapes:
            invariant_gemm.gemm(torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16))

    return case


def _invariant_attention(hq: int, hkv: int, batch: int, ctx: int = 1024) -> Callable[[], None]:
    """batch_invariant.attend's CUDA kernels for a decode step of `batch` rows at `ctx` (split-KV where
    batch_invariant.splits splits it: the split and merge kernels), 16-token pages."""

    def case() -> None:
        from engine.layers import batch_invariant as bi
        from engine.layers import triton_ops

        d, ps = 128, 16
        table = torch.arange(batch * (ctx // ps + 1), dtype=torch.int32).view(batch, -1)
        p = bi.plan(table, [ctx] * batch, [1] * batch, ps, kernel=True, tokens=bi.kernel_tokens(hq // hkv))
        nb = p.rows.shape[0]
        s = bi.splits(nb, hkv, p.parts)
        kc = torch.empty(table.numel() * ps, hkv, d, dtype=torch.bfloat16)
        triton_ops.invariant_attention(torch.empty(batch, hq, d, dtype=torch.bfloat16), kc, kc, ps, table, p.blocks,
                                       bi.kv_chunk(ps), bi.kv_part(ps), s,
                                       bi.split_scratch(nb, p.parts, hq, d, "cpu") if s > 1 else None)

    return case


def _sampler(vocab: int, rows: int) -> Callable[[], None]:
    """The sampler's kernels: the race's noise over a whole row and over candidate ids, and the
    deterministic candidates' rank keys."""

    def case() -> None:
        from engine.layers import triton_ops
        from engine.run.noise import _UNIFORM_BITS

        seeds = torch.zeros(rows, dtype=torch.int64)
        for ids in (None, torch.zeros(rows, 20, dtype=torch.int64)):
            triton_ops.race_noise_(torch.zeros(rows, vocab if ids is None else 20), seeds, seeds, ids, _UNIFORM_BITS)
        triton_ops.rank_keys(torch.zeros(rows, vocab))

    return case


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
QWEN3_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]

CASES: dict[str, Callable[[], None]] = {
    "gemv-llama": _gemvs(LLAMA_8B),
    "gemv-llama-fp8": _gemvs(LLAMA_8B, fp8=True),
    "det-llama-b1": _invariant(1, LLAMA_8B),  # deterministic inference's batch-1 GEMV
    "det-llama-b256": _invariant(256, LLAMA_8B),  # offline decode batches
    "det-llama-prefill": _invariant(4096, LLAMA_8B),
    "det-qwen-b256": _invariant(256, QWEN3_06B),
    "det-attn-llama-b1": _invariant_attention(32, 8, 1),  # deterministic decode attention: split + merge
    "det-attn-a3b-b1": _invariant_attention(32, 4, 1),  # a GQA group of 8
    "det-attn-llama-b64": _invariant_attention(32, 8, 64),  # the serial kernel
    "decode-llama": _decode(32, 8, False),  # Llama-3.1-8B
    "decode-a3b": _decode(32, 4, True),  # Qwen3-30B-A3B: a GQA group of 8, q/k norm
    "moe-a3b": _moe_one_token(2048, 128, 8, 768),
    "moe-fused-a3b": _moe_fused(2048, 128, 8, 768, 8),  # batch 8's MoE launches
    "sampler-llama-b64": _sampler(128256, 64),
}


def check(names: list[str]) -> list[tuple[str, str, int, int, str]]:
    """(case, kernel, registers, stack bytes, its largest tensor's shape) of every launch of the named
    cases, compiled for the H200."""
    rows = []
    for name in names:
        with recorded() as launches:
            CASES[name]()
        if not launches:
            raise RuntimeError(f"case {name} launched no triton kernel")
        for fn, args, kwargs in launches:
            tensors = [a.base if isinstance(a, TensorDescriptor) else a for a in (*args, *kwargs.values())]
            big = max((a for a in tensors if isinstance(a, torch.Tensor)), key=torch.Tensor.numel)
            rows.append((name, fn.__name__, *resources(compile_launch(fn, args, kwargs)), str(list(big.shape))))
    return rows


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        sys.exit(f"compile_check: unknown cases {unknown} (cases: {', '.join(CASES)})")
    for case, kernel, regs, stack, shape in check(names):
        print(f"{case:14} {kernel:28} registers {regs:3}  spilled {stack:5} bytes a thread  {shape}", flush=True)


if __name__ == "__main__":
    main()
