"""Which kernels fill a decode step? (device diagnostic, not in CI)

    python3 scripts/profile_decode.py configs/llama-3.1-8b 256 1500 [det]

Prefills `batch` random prompts of `ctx` tokens with LocalEngine (CUDA graphs off so the
profiler sees every kernel), then profiles decode steps and prints the kernels by GPU time.
With `det`: under deterministic inference, and the prefill's kernels too.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.codec import pack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest


def table(prof: profile, title: str, steps: int) -> None:
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"{title}: {total:.2f} ms of kernels per {'decode step' if steps > 1 else 'run'}")
    for e in events[:24]:
        ms = e.self_device_time_total / steps / 1e3
        print(f"  {ms:7.3f} ms  {100 * ms / total:5.1f}%  x{e.count // steps:<4} {e.key[:150]}")


def main(model: str, batch: int, ctx: int, det: bool = False, steps: int = 5) -> None:
    cfg = ServerConfig(
        model=model,
        load_format="dummy",
        device="cuda",
        max_running_requests=batch,
        max_prefill_tokens=16384,
        disable_cuda_graph=True,
        enable_deterministic_inference=det,
        max_total_tokens=batch * (ctx + 64),
    )
    eng = LocalEngine(cfg)
    core, runner = eng.core, eng.runner
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    for i in range(batch):
        ids = pack_ids([(31 * i + j) % 30000 + 1 for j in range(ctx)])
        core.submit(TokenizedRequest(rid=f"p{i}", input_ids=ids, params=params))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prefill:
        while core.waiting or any(r.in_prefill for r in core.running):
            core.on_done(runner.run_step(core.plan()))
        torch.cuda.synchronize()
    if det:
        table(prefill, f"{model} prefill of {batch} x {ctx} tokens", 1)
    for _ in range(3):
        core.on_done(runner.run_step(core.plan()))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.on_done(runner.run_step(core.plan()))
        torch.cuda.synchronize()
    table(prof, f"{model} batch {batch} ctx {ctx}: decode", steps)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["det"])
