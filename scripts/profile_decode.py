"""Which kernels fill a decode step? (device diagnostic, not in CI)

    python3 scripts/profile_decode.py configs/llama-3.1-8b 256 1500 [--det] [--graphs] [--quantization fp8]

Prefills `batch` random prompts of `ctx` tokens with LocalEngine, then profiles decode steps and
prints the kernels by GPU time. Two columns: a kernel's span (start to end, as CUPTI reports it)
and its attributed time (end minus the later of its start and the previous kernel's end). With
programmatic dependent launch a kernel starts before its predecessor ends, so spans overlap and
sum to more than the step; attributed times do not overlap and sum to the busy time of the step,
and the gap column is the idle time between kernels. `--graphs` replays the CUDA graphs, as the
served worker does (CUPTI sees the kernels inside them); without it every kernel is launched eagerly.
With `--det`: under deterministic inference. The prefill's kernels are printed first, in either mode.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.codec import pack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest


def kernels(prof: profile) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every GPU kernel and copy, in start order."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.duration_ns() > 0:
            out.append((ev.start_ns(), ev.start_ns() + ev.duration_ns(), ev.name()))
    return sorted(out)


def table(prof: profile, title: str, steps: int) -> None:
    span: dict[str, float] = defaultdict(float)
    owned: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    ks = kernels(prof)
    prev_end, gaps = None, 0.0
    for start, end, name in ks:
        span[name] += end - start
        count[name] += 1
        if prev_end is not None and start > prev_end:
            gaps += start - prev_end
        owned[name] += max(0, end - max(start, prev_end or start))
        prev_end = end if prev_end is None else max(prev_end, end)
    wall = (ks[-1][1] - ks[0][0]) / steps / 1e6 if ks else 0.0
    busy, spans = sum(owned.values()) / steps / 1e6, sum(span.values()) / steps / 1e6
    print(f"{title}: first kernel to last {wall:.3f} ms per {'decode step' if steps > 1 else 'run'}, "
          f"busy {busy:.3f} ms, gaps {gaps / steps / 1e6:.3f} ms, spans summed {spans:.3f} ms")
    print("  attributed    span    share  launches  kernel")
    for name in sorted(owned, key=owned.get, reverse=True)[:28]:
        ms, sp = owned[name] / steps / 1e6, span[name] / steps / 1e6
        print(f"  {ms:8.3f} {sp:8.3f} ms {100 * ms / max(busy, 1e-9):5.1f}%  x{count[name] // steps:<5} {name[:140]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("ctx", type=int)
    ap.add_argument("--det", action="store_true", help="deterministic inference")
    ap.add_argument("--graphs", action="store_true", help="replay the decode CUDA graphs, as served")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (per-channel weights quantized at load)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8_e4m3: the offline benchmark's KV cache")
    ap.add_argument("--attention-fp8-math", action="store_true", help="XQA's fp8 math over an fp8 KV cache")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    cfg = ServerConfig(
        model=a.model,
        load_format="dummy",
        device="cuda",
        max_running_requests=a.batch,
        max_prefill_tokens=16384,
        disable_cuda_graph=not a.graphs,
        enable_deterministic_inference=a.det,
        quantization=a.quantization or "",
        kv_cache_dtype=a.kv_cache_dtype,
        attention_fp8_math=a.attention_fp8_math,
        max_total_tokens=a.batch * (a.ctx + 64),
    )
    eng = LocalEngine(cfg)
    core, runner = eng.core, eng.runner
    params = SamplingParams(max_new_tokens=a.steps + 30, temperature=0, ignore_eos=True)
    for i in range(a.batch):
        ids = pack_ids([(31 * i + j) % 30000 + 1 for j in range(a.ctx)])
        core.submit(TokenizedRequest(rid=f"p{i}", input_ids=ids, params=params))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prefill:
        while core.waiting or any(r.in_prefill for r in core.running):
            core.on_done(runner.run_step(core.plan()))
        torch.cuda.synchronize()
    table(prefill, f"{a.model} prefill of {a.batch} x {a.ctx} tokens", 1)
    for _ in range(3):
        core.on_done(runner.run_step(core.plan()))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            core.on_done(runner.run_step(core.plan()))
        torch.cuda.synchronize()
    mode = "graphs" if a.graphs else "eager"
    table(prof, f"{a.model} batch {a.batch} ctx {a.ctx} ({mode}, {a.quantization or 'unquantized'}): decode", a.steps)


if __name__ == "__main__":
    main()
