"""The torch backend's captured deterministic decode (engine/layers/attention.py, `_graph_attend`)
run by triton's interpreter on the CPU, as engine/run/cuda_graph.py drives it (graph_wrapper, then
per step set_graph_table and the forward's layers): the same bits as the eager plan's kernel
blocks for the real rows, over steps whose page tables narrow (stale columns) and with padding
rows. Skipped where triton is not installed; the compiled kernel in a real graph is
tests/gpu/test_deterministic_graphs_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import batch_invariant as bi  # noqa: E402
from engine.layers.attention import TorchAttention  # noqa: E402
from engine.layers.forward import ForwardBatch  # noqa: E402
from engine.layers.kv_pool import PAD_PAGE, KVPool  # noqa: E402
from engine.run.cuda_graph import decode_table  # noqa: E402

PS, HQ, HKV, D = 16, 4, 2, 32


def _step(starts: list[int], tables: list[list[int]], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, dense table) of a decode step staged as the graph runner does, padded to bs."""
    _, seq, table = decode_table(starts, tables, PS)
    b, w = table.shape
    seqs = torch.ones(bs, dtype=torch.int32)
    seqs[:b] = torch.from_numpy(seq)
    full = torch.full((bs, w), PAD_PAGE, dtype=torch.int32)
    full[:b] = torch.from_numpy(table)
    return seqs, full


def test_graph_decode_equals_the_eager_plan_bitwise() -> None:
    g = torch.Generator().manual_seed(7)
    pool = KVPool(2, 40, PS, HKV, D, torch.float32, "cpu")
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=g))
    backend = TorchAttention("cpu")
    bi.enable(True, "cpu")
    backend.bind(num_q_heads=HQ, kv_pool=pool, max_batch=8, max_pages_per_req=12)
    backend.bind_graphs(8, 12)  # what bind does on CUDA, where the kernel fits
    bs = 8
    backend.graph_wrapper(bs)
    perm = (torch.randperm(39, generator=g) + 1).tolist()  # pages off the padding page, shuffled
    steps = [([150, 64, 3, 130, 9], [perm[0:11], perm[11:16], perm[16:18], perm[18:28], perm[28:30]]),
             ([63, 64, 20], [perm[30:34], perm[34:39], perm[0:2]])]  # narrower: stale columns past it
    for starts, tables in steps:
        b = len(starts)
        seqs, table = _step(starts, tables, bs)
        backend.set_graph_table(bs, seqs, table)
        eager = bi.plan(table[:b], seqs[:b].tolist(), [1] * b, PS, kernel=True)
        batch = ForwardBatch.build(list(range(b)), starts, [1] * b, tables, [1] * b, PS, "cpu")
        for layer in (0, 1):  # layer 1 reads the blocks layer 0 built
            q = torch.randn(bs, HQ, D, generator=g)
            got = backend.attend(q, layer, batch, pool)
            want = bi.attend(q[:b], eager, pool, layer)
            assert torch.equal(got[:b], want), (starts, layer)
            assert torch.isfinite(got).all()  # the padding rows attend the padding page
        torch.testing.assert_close(want, bi.attend(q[:b], bi.plan(table[:b], seqs[:b].tolist(), [1] * b, PS),
                                                   pool, 1), atol=1e-5, rtol=1e-5)  # and the torch path
    backend.prepare(batch)
    assert backend._graph is None
