"""Context parallelism's attention work per rank on CPU (one thread, float32, one layer).

.venv/bin/python scripts/cp_attention_cpu.py [--tokens 4096] [--page 16]

The default model's attention shapes (9 q heads over 3 K/V heads of 64): a fresh prefill of
--tokens and one decode at that context, by TorchAttention over one pool (cp 1) and by each
rank's ContextParallelAttention.partial over its own half of the pages (cp 2; the all-gather and
merge not included). Each cp 2 figure should be about half of cp 1's: that is the split.
Prints the best of a few runs in ms.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.layers.attention import TorchAttention
from engine.layers.cp_attention import ContextParallelAttention, page_owner
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.parallel import TPGroup

HQ, HKV, D = 9, 3, 64


def best_ms(f: Callable[[], object], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n, ps = a.tokens, a.page
    pages = -(-n // ps)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    pool = KVPool(1, pages + 1, ps, HKV, D, torch.float32, "cpu")
    ref = TorchAttention("cpu")
    owned, table = [1, 1], []
    for i in range(pages):  # one page table: entry i is a page of owner i % 2's pool
        table.append(owned[page_owner(i, 2)])
        owned[page_owner(i, 2)] += 1
    for name, new, rows, reps in (("prefill", list(range(n)), slice(None), 3), ("decode", [n - 1], slice(0, 1), 20)):
        start = new[0]
        b1 = ForwardBatch.from_requests([([5] * len(new), start, list(range(1, pages + 1)))], ps, "cpu")
        ref.prepare(b1)
        ms = best_ms(lambda b1=b1, rows=rows: ref.forward(q[rows], k[rows], v[rows], 0, b1, pool), reps)
        print(f"{name} {n}: cp 1 {ms:.2f} ms", end="")
        b2 = ForwardBatch.from_requests([([5] * len(new), start, table)], ps, "cpu")
        for r in range(2):
            be = ContextParallelAttention(TPGroup(r, 2))
            be.prepare(b2)
            mine = KVPool(1, max(owned), ps, HKV, D, torch.float32, "cpu")
            if name == "prefill":  # its pages' K/V (a decode's timing does not depend on the values)
                be.store_rows(0, mine, k, v)
            ms = best_ms(lambda be=be, mine=mine, rows=rows: be.partial(q[rows], k[rows], v[rows], 0, mine), reps)
            print(f", cp 2 rank {r} {ms:.2f} ms", end="")
        print()


if __name__ == "__main__":
    main()
