"""What the sampler costs a decode step on the GPU, deterministic inference off and on (issue 21:
under the mode top_k candidates come from `ranking.ranked_topk`, top_p's mass from a cumsum).

For each vocabulary, batch and parameter mix: the median over timed repeats of `Sampler.sample`
(on CUDA, events around each call on one stream; on a CPU, the wall clock), after warm-up, in
microseconds. Prints a table and writes JSON to the path given (default: stdout only).

    python scripts/sampler_cost.py [OUT.json]                      # CUDA: Llama's and Qwen3's vocabularies
    python scripts/sampler_cost.py [OUT.json] --device cpu --vocab 49152 --batches 1 16   # the default model's
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.run.sample_params import SampleParams  # noqa: E402
from engine.run.sampler import Sampler  # noqa: E402

VOCABS = {"llama-3.1-8b": 128256, "qwen3": 151936}
BATCHES = (1, 8, 64)
MIXES = {  # every row the same parameters, seeds apart
    "temperature": dict(temperature=0.8),
    "top_k 20": dict(temperature=0.8, top_k=20),
    "top_k 20 top_p 0.95": dict(temperature=0.8, top_k=20, top_p=0.95),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
}
REPEATS, WARM = 100, 10


def _median_us(sampler: Sampler, logits: torch.Tensor, slots: torch.Tensor) -> float:
    positions = torch.arange(logits.shape[0], device=logits.device)
    cuda = logits.is_cuda
    times = []
    for i in range(WARM + REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        sampler.sample(logits, slots, positions + i)
        if cuda:
            end.record()
            end.synchronize()
        if i >= WARM:
            times.append(start.elapsed_time(end) * 1000 if cuda else (time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON result path")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes (default: Llama-3.1-8B's and Qwen3's)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    args = p.parse_args()
    dev = torch.device(args.device)
    vocabs = {f"v{v}": v for v in args.vocab} if args.vocab else VOCABS
    torch.manual_seed(0)
    rows = []
    for name, vocab in vocabs.items():
        for batch in args.batches:
            logits = (torch.randn(batch, vocab, device=dev) * 3).bfloat16().float()
            slots = torch.arange(batch, device=dev) if dev.type == "cuda" else list(range(batch))  # as served
            for mix, kw in MIXES.items():
                row = {"vocab": name, "batch": batch, "params": mix}
                for det in (False, True):
                    s = Sampler(vocab, batch, dev, deterministic=det)
                    s.warm()
                    for slot in range(batch):
                        s.add(slot, SampleParams(seed=slot + 1, **kw))
                    row["det_us" if det else "off_us"] = round(_median_us(s, logits, slots), 1)
                rows.append(row)
                print(f"{name:13s} b{batch:<3d} {mix:22s} off {row['off_us']:8.1f} us  det {row['det_us']:8.1f} us"
                      f"  ({row['det_us'] / row['off_us']:.2f}x)", flush=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    result = {"device": name, "repeats": REPEATS, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
