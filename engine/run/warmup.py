"""Ready means warm: run every kernel the configured path will use once, before the worker
reports ready, so no request pays a compile (flashinfer's JIT, triton, torch.compile).

Covered: an eager prefill (a fresh prompt and one continuing after a cached page, so both
attention paths run) and an eager decode batch, in the configured dtype, KV dtype and
attention math; the sampler's greedy, temperature, top-k/top-p/min-p, penalty and logprob
paths. Decode CUDA graphs are captured (and so run) separately, for every batch size.
The KV written here lands in free pages: every page is written by its request's prefill
before anything reads it, so the garbage is never seen.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.layers.forward import ForwardBatch
from engine.run.sampler import SampleParams

if TYPE_CHECKING:
    from engine.run.runner import ModelRunner

# greedy; temperature with every filter, penalties and logprobs; plain temperature
_PARAMS = (
    SampleParams(seed=1, temperature=0.0),
    SampleParams(seed=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                 frequency_penalty=0.5, presence_penalty=0.5, logprobs=True, top_logprobs=2),
    SampleParams(seed=3, temperature=1.0),
)


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> float:
    """Seconds spent; leaves the sampler's slots and the replica untouched."""
    t0 = time.perf_counter()
    ps = runner.page_size
    pages = list(range(1, min(runner.num_pages, 1 + 3)))  # free pages: nothing is admitted yet
    n = min(2 * ps, len(pages) * ps - ps)  # a short prompt; the second request starts after one page
    if n < 1:
        return 0.0
    slots = list(range(min(len(_PARAMS), runner.cfg.max_running_requests)))
    for slot, params in zip(slots, _PARAMS, strict=False):
        runner.sampler.add(slot, params, prompt_ids=[1, 2, 3])
    try:
        prefill = _forward(runner, [0, ps, 0][: len(slots)], [n, n - ps if n > ps else 1, n][: len(slots)], pages)
        runner.sampler.sample(prefill, slots, [n] * len(slots))
        decode = _forward(runner, [n] * len(slots), [1] * len(slots), pages)
        runner.sampler.sample(decode, slots, [n + 1] * len(slots))
    finally:
        for slot in slots:
            runner.sampler.remove(slot)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0


def _forward(runner: ModelRunner, starts: list[int], lens: list[int], pages: list[int]) -> torch.Tensor:
    ids = [1 + i % 7 for i in range(sum(lens))]
    batch = ForwardBatch.build(ids, starts, lens, [pages] * len(lens), [1] * len(lens), runner.page_size,
                               runner.device)
    runner.backend.prepare(batch)
    return runner.model(batch, runner.kv, runner.backend)
