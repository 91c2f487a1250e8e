"""Which CUDA ops keep a row's bits when the batch around it changes (deterministic inference,
engine/layers/batch_invariant.py): batched GEMMs by batch count, fixed-row GEMM blocks by
where the block lies, log_softmax by row count. Prints the counts that differ."""

from __future__ import annotations

import torch

torch.manual_seed(0)
dev = torch.device("cuda")


def bmm_sweep(m: int, k: int, n: int, dtype: torch.dtype) -> list[int]:
    a = torch.randn(1024, m, k, device=dev, dtype=dtype)
    b = torch.randn(1024, k, n, device=dev, dtype=dtype)
    ref = torch.bmm(a[:1], b[:1])
    return [c for c in range(1, 1025) if not torch.equal(torch.bmm(a[:c], b[:c])[:1], ref)]


for shape in ((32, 128, 64), (32, 64, 129), (32, 64, 128), (48, 64, 64)):
    bad = bmm_sweep(*shape, torch.float32)
    print(f"bmm fp32 {shape}: batch counts whose entry 0 differs: {len(bad)} {bad[:12]}", flush=True)
a = torch.randn(64, 32, 128, device=dev)
b = torch.randn(64, 128, 64, device=dev)
x_a, x_b = torch.randn(32, 128, device=dev), torch.randn(128, 64, device=dev)
outs = []
for p in (0, 5, 31, 63):
    a2, b2 = a.clone(), b.clone()
    a2[p], b2[p] = x_a, x_b
    outs.append(torch.bmm(a2, b2)[p])
print(f"bmm of 64: one entry keeps its bits at any position beside any others: "
      f"{all(torch.equal(o, outs[0]) for o in outs)}", flush=True)
w = torch.randn(3072, 1024, device=dev, dtype=torch.bfloat16)
x = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
ref = torch.nn.functional.linear(x[:64].clone(), w)
same = all(torch.equal(torch.nn.functional.linear(torch.cat([x[:64 - j], x[100:100 + j]]), w)[: 64 - j], ref[: 64 - j])
           for j in range(0, 64, 5))
print(f"linear 64-row block: a row keeps its bits beside other rows: {same}", flush=True)
for rows in (1, 2, 5, 8, 64):
    logits = torch.randn(64, 151936, device=dev)
    print(f"log_softmax rows {rows}: row 0 same as alone: "
          f"{torch.equal(logits[:rows].log_softmax(-1)[0], logits[:1].log_softmax(-1)[0])}", flush=True)
