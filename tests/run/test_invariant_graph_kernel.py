"""The torch backend's captured deterministic decode (engine/layers/attention.py, `_graph_attend`)
run by triton's interpreter on the CPU, as engine/run/cuda_graph.py drives it (graph_wrapper, then
per step set_graph_table and the forward's layers): the same bits as the eager plan's kernel
blocks for the real rows, over steps whose page tables narrow (stale columns) and with padding
rows. Skipped where triton is not installed; the compiled kernel in a real graph is
tests/gpu/test_deterministic_graphs_gpu.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import batch_invariant as bi  # noqa: E402
from engine.layers.attention import TorchAttention  # noqa: E402
from engine.layers.forward import ForwardBatch  # noqa: E402
from engine.layers.kv_pool import PAD_PAGE, KVPool  # noqa: E402
from engine.run.cuda_graph import decode_table  # noqa: E402
from tests.engine.test_deterministic_graph_blocks import staged  # noqa: E402

PS, HQ, HKV, D = 16, 4, 2, 32
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _step(starts: list[int], tables: list[list[int]], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens, dense table) of a decode step staged as the graph runner does, padded to bs."""
    return staged(starts, tables, PS, bs)


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


def test_model_decode_through_the_graph_protocol_equals_eager() -> None:
    """A tiny Qwen3's whole decode forward fed as a captured graph is (the static batch of
    cuda_graph.CudaGraphRunner: padding page table, every row's length 1 on the host, the
    real lengths and table only in the backend's buffers) gives the eager step's logits bit
    for bit: nothing outside attention reads the batch's host lengths or page table."""
    from models.registry import kv_layout, load_model

    bi.enable(True, "cpu")
    model, cfg = load_model(REPO_CONFIGS / "tiny-qwen3", "dummy", torch.float32, "cpu", progress=False)
    pool = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 48, PS, torch.float32, "cpu")
    backend = TorchAttention("cpu")
    backend.bind(num_q_heads=cfg.num_heads, kv_pool=pool, max_batch=8, max_pages_per_req=12)
    backend._kernel = True  # the eager plan for the kernel, as on CUDA (bind's kernel_fits needs CUDA)
    backend._cpu_kernel = False  # (which the CPU's own kernel would otherwise take)
    backend.bind_graphs(8, 12)
    lens = [70, 5, 130]
    tables = [list(range(1, 7)), list(range(7, 9)), list(range(9, 19))]
    prompts = [[(11 * i + 5 * r) % 250 + 3 for i in range(n)] for r, n in enumerate(lens)]
    batch = ForwardBatch.build(sum(prompts, []), [0, 0, 0], lens, tables, [1, 1, 1], PS, "cpu")
    backend.prepare(batch)
    ids = model(batch, pool, backend).argmax(-1).tolist()
    batch = ForwardBatch.build(ids, lens, [1, 1, 1], tables, [1, 1, 1], PS, "cpu")
    backend.prepare(batch)
    assert backend._invariant is not None and backend._invariant[0].kernel
    want = model(batch, pool, backend)
    bs, b = 4, 3
    static = ForwardBatch(input_ids=torch.zeros(bs, dtype=torch.int64), positions=torch.zeros(bs, dtype=torch.int64),
                          out_slots=torch.zeros(bs, dtype=torch.int64),
                          page_table=torch.full((bs, 1), PAD_PAGE, dtype=torch.int32),
                          seq_lens=torch.ones(bs, dtype=torch.int32), extend_lens=torch.ones(bs, dtype=torch.int32),
                          logit_indices=torch.arange(bs), seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs,
                          page_size=PS, is_decode=True)
    backend.graph_wrapper(bs)
    model(static, pool, backend)  # the capture's forward: every row padding
    out_slots, seq, table = decode_table(lens, tables, PS)
    static.input_ids[:b], static.positions[:b] = torch.tensor(ids), torch.tensor(lens)
    static.out_slots[:b] = torch.from_numpy(out_slots)
    seqs, full = torch.ones(bs, dtype=torch.int32), torch.full((bs, table.shape[1]), PAD_PAGE, dtype=torch.int32)
    seqs[:b], full[:b] = torch.from_numpy(seq), torch.from_numpy(table)
    backend.set_graph_table(bs, seqs, full)
    assert backend._graph is not None
    got = model(static, pool, backend)  # a replay's inputs
    assert torch.equal(got[:b], want)
