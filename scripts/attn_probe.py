"""Decode-attention and attention-prologue kernel probe (GPU only; run on the device).

Times, per decode step of L layers captured in one CUDA graph, and checks against a float32
reference:
  * paged decode attention: flashinfer's tensor-core decode (FA2 prefill kernel + merge),
    flashinfer's XQA decode (TRT-LLM kernel; bf16 KV and, on SM90, the fp8 GMMA kernel);
  * the attention prologue: q/k RMSNorm + RoPE + K/V store as separate kernels versus
    engine/run/triton_ops.qk_norm_rope_store;
  * a layer's whole decode attention from its QKV projection: that prologue + flashinfer's
    tensor-core decode (+ merge) versus engine/run/triton_ops.decode_attention (one launch),
    over batch sizes and kernel configs (block_n, warps, splits).

Usage: python3 scripts/attn_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.run import ops, triton_ops  # noqa: E402

DEV = torch.device("cuda")
PS = 16


def graph_ms(fn, reps: int = 20) -> float:  # noqa: ANN001
    """ms per call of fn() (one decode step's worth of kernels), captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def make_kv(layers: int, batch: int, ctx: int, hkv: int, d: int, dtype: torch.dtype):  # noqa: ANN201
    """Per-layer (k, v) [pages, PS, hkv, d] and a shuffled page table [batch, ctx/PS] (page 0 unused)."""
    npages = batch * math.ceil(ctx / PS)
    kv = []
    for _ in range(layers):
        k = (torch.randn(npages + 1, PS, hkv, d, device=DEV, dtype=torch.bfloat16) * 0.5).to(dtype)
        v = torch.randn(npages + 1, PS, hkv, d, device=DEV, dtype=torch.bfloat16).to(dtype)
        kv.append((k, v))
    perm = torch.randperm(npages, device=DEV).to(torch.int32) + 1
    table = perm.view(batch, -1)
    return kv, table


def fa2_decode(ws, table, seq, hq: int, hkv: int, d: int, kv_dtype: torch.dtype):  # noqa: ANN001, ANN201
    """flashinfer's tensor-core decode (the FA2 backend's), graph-capturable, planned for seq over table."""
    import flashinfer

    batch = seq.shape[0]
    npages = (seq + PS - 1) // PS
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(npages, 0)
    cols = torch.arange(table.shape[1], device=DEV)[None, :] < npages[:, None]
    indices = table[cols].contiguous()
    last = (seq - (npages - 1) * PS).to(torch.int32)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.clone(),
    )
    w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, PS, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    return w


def ref_attention(q, k, v, table, seq_lens):  # noqa: ANN001, ANN201
    out = []
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        pages = table[i, : math.ceil(n / PS)].long()
        ki = k[pages].reshape(-1, *k.shape[2:])[:n].float()
        vi = v[pages].reshape(-1, *v.shape[2:])[:n].float()
        g = q.shape[1] // k.shape[2]
        ki, vi = ki.repeat_interleave(g, 1), vi.repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), ki) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vi))
    return torch.stack(out)


def probe_attention(name: str, hq: int, hkv: int, batch: int, ctx: int, layers: int, results: list) -> None:
    d = 128
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    seq[::2] = ctx - 7  # ragged last pages
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    xws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        _attention_case(name, hq, hkv, batch, ctx, layers, kv_dtype, q, seq, ws, xws, results)
        torch.cuda.empty_cache()


def _attention_case(name, hq, hkv, batch, ctx, layers, kv_dtype, q, seq, ws, xws, results) -> None:  # noqa: ANN001

    d = 128
    kv, table = make_kv(layers, batch, ctx, hkv, d, kv_dtype)
    ref = ref_attention(q[:4], *kv[0], table[:4], seq[:4])
    row = {"case": name, "batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "kv_dtype": str(kv_dtype)}
    kv_bytes = layers * int(seq.sum()) * hkv * d * 2 * kv_dtype.itemsize
    # flashinfer tensor-core decode (the current backend), graph-capturable wrapper
    w = fa2_decode(ws, table, seq, hq, hkv, d, kv_dtype)
    err_fa = (w.run(q, kv[0])[:4].float() - ref).abs().max().item()
    t_fa = graph_ms(lambda: [w.run(q, kv[i]) for i in range(layers)])
    from flashinfer.xqa import get_xqa_module

    op = get_xqa_module(torch.bfloat16, kv_dtype, PS, d, hq // hkv, False, torch.bfloat16, 1).xqa
    sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    out = torch.empty_like(q)
    variants = [("xqa", False, True), ("xqa_nopdl", False, False)]
    if kv_dtype.itemsize == 1:
        variants.append(("xqa_fp8gmma", True, True))

    def xqa(i: int, gmma: bool, pdl: bool) -> torch.Tensor:
        op(gmma, sm, hkv, 0, 1.0, out.view(batch, 1, hq, d), 1.0, q.view(batch, 1, hq, d), None, kv[i][0], kv[i][1],
           None, None, table, table.shape[1] * PS, seq.view(batch, 1), batch, 1.0, xws[: 8 << 20], xws[8 << 20 :],
           pdl, 1, None)
        return out

    for label, gmma, pdl in variants:
        try:
            err = (xqa(0, gmma, pdl)[:4].float() - ref).abs().max().item()
            t = graph_ms(lambda g=gmma, p=pdl: [xqa(i, g, p) for i in range(layers)])
        except Exception as e:  # noqa: BLE001
            print(f"{label} {name} {kv_dtype} failed: {e!r}"[:600])
            err, t = float("nan"), float("nan")
        row[f"{label}_ms"], row[f"{label}_err"] = t, err
    gb = kv_bytes / 1e9
    row.update(fa2_tc_ms=t_fa, fa2_tc_err=err_fa, kv_gb=gb)
    results.append(row)
    xs = " | ".join(f"{lb} {row[lb + '_ms']:7.3f} ms (err {row[lb + '_err']:.3g})" for lb, _, _ in variants)
    print(f"{name:8s} b={batch:3d} ctx={ctx:5d} {str(kv_dtype):20s} KV {gb:6.3f} GB | "
          f"fa2-tc {t_fa:7.3f} ms (err {err_fa:.3g}) | {xs}", flush=True)


def probe_prologue(name: str, hq: int, hkv: int, norm: bool, batch: int, layers: int, results: list) -> None:
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        _prologue_case(name, hq, hkv, norm, batch, layers, kv_dtype, results)


def _prologue_case(name, hq, hkv, norm, batch, layers, kv_dtype, results) -> None:  # noqa: ANN001
    d = 128
    width = (hq + 2 * hkv) * d
    slots_n = 4096 * PS
    pos = torch.randint(0, 4000, (batch,), device=DEV)
    slots = torch.randperm(slots_n - PS, device=DEV)[:batch] + PS
    rot = ops.Rotary(1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)), d, 8192)
    cache = rot.cos_sin_cache(DEV)
    qw = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    qkv = [torch.randn(batch, width, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    kc = [torch.zeros(slots_n, hkv, d, device=DEV, dtype=kv_dtype) for _ in range(layers)]
    vc = [torch.zeros(slots_n, hkv, d, device=DEV, dtype=kv_dtype) for _ in range(layers)]

    def unfused(i: int) -> torch.Tensor:
        q, k, v = qkv[i].split([hq * d, hkv * d, hkv * d], -1)
        q, k, v = q.reshape(batch, hq, d), k.reshape(batch, hkv, d), v.reshape(batch, hkv, d)
        if norm:
            q, k = ops.rms_norm(q, qw, 1e-6), ops.rms_norm(k, kw, 1e-6)
        q, k = rot.apply(q, k, ("fused", pos, cache))
        raw = kv_dtype.itemsize == 1
        kk, vv = k.to(kv_dtype), v.to(kv_dtype)
        (kc[i].view(torch.uint8) if raw else kc[i]).index_copy_(0, slots, kk.view(torch.uint8) if raw else kk)
        (vc[i].view(torch.uint8) if raw else vc[i]).index_copy_(0, slots, vv.view(torch.uint8) if raw else vv)
        return q

    def fused(i: int) -> torch.Tensor:
        return triton_ops.qk_norm_rope_store(
            qkv[i], hq, hkv, d, pos, cache, slots, kc[i], vc[i], qw if norm else None, kw if norm else None, 1e-6
        )

    src = qkv[0].clone()  # the unfused rotary works in place on qkv: restore it for the fused run
    q_ref = unfused(0).clone()
    k_ref, v_ref = kc[0][slots].float(), vc[0][slots].float()
    qkv[0].copy_(src)
    kc[0].zero_()
    vc[0].zero_()
    q_f = fused(0)
    errs = (
        (q_f.float() - q_ref.float()).abs().max().item(),
        (kc[0][slots].float() - k_ref).abs().max().item(),
        (vc[0][slots].float() - v_ref).abs().max().item(),
    )
    t_u = graph_ms(lambda: [unfused(i) for i in range(layers)])
    t_f = graph_ms(lambda: [fused(i) for i in range(layers)])
    results.append({"case": name, "batch": batch, "kv_dtype": str(kv_dtype), "unfused_ms": t_u,
                    "fused_ms": t_f, "max_err_q_k_v": errs})
    print(f"prologue {name:8s} b={batch:3d} {str(kv_dtype):20s} unfused {t_u:.3f} ms | fused {t_f:.3f} ms | "
          f"err q/k/v {errs[0]:.3g}/{errs[1]:.3g}/{errs[2]:.3g}", flush=True)


def probe_fused(name: str, hq: int, hkv: int, norm: bool, batch: int, ctx: int, layers: int, results: list,
                kv_dtype: torch.dtype = torch.bfloat16) -> None:

    d = 128
    kv, table = make_kv(layers, batch, ctx + 1, hkv, d, kv_dtype)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    seq[::2] = ctx - 7
    pos = (seq - 1).to(torch.int64)
    slots = table.gather(1, (pos // PS)[:, None]).long()[:, 0] * PS + pos % PS
    rot = ops.Rotary(1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)), d, ctx + 8)
    cache = rot.cos_sin_cache(DEV)
    qw = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    nw = (qw, kw) if norm else (None, None)
    qkv = [torch.randn(batch, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    flat = [(k.view(-1, hkv, d), v.view(-1, hkv, d)) for k, v in kv]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    w = fa2_decode(ws, table, seq, hq, hkv, d, kv_dtype)

    def current(i: int) -> torch.Tensor:
        q = triton_ops.qk_norm_rope_store(qkv[i], hq, hkv, d, pos, cache, slots, *flat[i], *nw, 1e-6)
        return w.run(q, kv[i])

    sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    tws = triton_ops.decode_workspace(batch, hkv, d, 4 * sm, DEV)

    def fused(i: int, splits: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
        return triton_ops.decode_attention(qkv[i], hq, hkv, d, pos, table, *flat[i], PS, tws, splits, cache,
                                           *nw, 1e-6, block_n=block_n, num_warps=warps, num_stages=stages)

    q0 = triton_ops.qk_norm_rope_store(qkv[0], hq, hkv, d, pos, cache, slots, *flat[0], *nw, 1e-6)
    n_ref = min(batch, 4)
    ref = ref_attention(q0[:n_ref], *kv[0], table[:n_ref], seq[:n_ref])
    err_cur = (current(0)[:n_ref].float() - ref).abs().max().item()
    t_cur = graph_ms(lambda: [current(i) for i in range(layers)])
    base = triton_ops.decode_splits(batch, hkv, sm)
    row = {"case": name, "batch": batch, "ctx": ctx, "kv_dtype": str(kv_dtype), "current_ms": t_cur,
           "current_err": err_cur, "default_splits": base, "configs": []}
    line = f"fused {name:8s} b={batch:3d} ctx={ctx:5d} {str(kv_dtype):15s} prologue+fa2 {t_cur:.3f} ms ({err_cur:.3g})"
    best = None
    half = max(1, base // 2)
    configs = ((base, 64, 4, 2), (base, 32, 4, 2), (base, 64, 8, 2), (base, 64, 2, 2), (base, 64, 4, 3),
               (half, 64, 4, 2), (half, 32, 4, 2))
    for splits, block_n, warps, stages in configs:
        try:
            err = (fused(0, splits, block_n, warps, stages)[:n_ref].float() - ref).abs().max().item()
            t = graph_ms(lambda a=(splits, block_n, warps, stages): [fused(i, *a) for i in range(layers)])
        except Exception as e:  # noqa: BLE001
            print(f"fused {name} {splits, block_n, warps, stages} failed: {e!r}"[:600])
            err, t = float("nan"), float("nan")
        row["configs"].append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages,
                               "ms": t, "err": err})
        if best is None or t < best[0]:
            best = (t, splits, block_n, warps, stages, err)
    row["default_ms"] = row["configs"][0]["ms"]
    results.append(row)
    print(f"{line} | triton default {row['default_ms']:.3f} ms ({row['configs'][0]['err']:.3g}) | best "
          f"{best[0]:.3f} ms at splits {best[1]} block_n {best[2]} warps {best[3]} stages {best[4]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip", nargs="*", default=[])
    a = ap.parse_args()
    torch.manual_seed(0)
    results: list = []
    if "prologue" not in a.skip:
        for name, hq, hkv, norm in (("llama8b", 32, 8, False), ("qwen3", 16, 8, True)):
            for b in (1, 256):
                probe_prologue(name, hq, hkv, norm, b, 32 if name == "llama8b" else 28, results)
    if "fused" not in a.skip:
        for name, hq, hkv, norm, layers in (("qwen3", 16, 8, True, 28), ("llama8b", 32, 8, False, 32)):
            for b in (1, 2, 4, 8, 16, 32):
                probe_fused(name, hq, hkv, norm, b, 1024, layers, results)
            probe_fused(name, hq, hkv, norm, 1, 8192, layers, results)
            probe_fused(name, hq, hkv, norm, 1, 1024, layers, results, torch.float8_e4m3fn)
    if "attention" not in a.skip:
        probe_attention("llama8b", 32, 8, 1, 1024, 32, results)
        probe_attention("qwen3", 16, 8, 1, 1024, 28, results)
        probe_attention("llama8b", 32, 8, 32, 1024, 32, results)
        probe_attention("llama8b", 32, 8, 256, 1500, 8, results)
    if a.json:
        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
