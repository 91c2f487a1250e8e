"""Deterministic decode in CUDA graphs (engine/layers/attention.py's torch backend on CUDA): the
kernel blocks a captured decode builds on the device (batch_invariant.DecodeBlocks) against the
eager plan's, for decode batches padded as engine/run/cuda_graph.py pads them, and the backend's
dense-table buffers. CPU only: the kernel itself is checked in tests/run/test_invariant_graph_kernel.py
(triton's interpreter) and tests/gpu/test_deterministic_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from engine.layers import batch_invariant as bi
from engine.layers.attention import TorchAttention
from engine.layers.kv_pool import PAD_PAGE, KVPool
from engine.run.cuda_graph import decode_table

BATCHES = [  # decode rows' positions (starts): chunk edges, a long row, a spec verify's consecutive rows
    [0],
    [63, 64, 5, 200, 127, 128],
    [300, 301, 302, 1, 64],
]


def _tables(starts: list[int], page_size: int) -> list[list[int]]:
    """Disjoint page tables off the padding page, with spare pages past each row's need."""
    nxt, out = 1, []
    for s in starts:
        n = s // page_size + 3
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def staged(starts: list[int], tables: list[list[int]], page_size: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens int32 [bs], page table int32 [bs, w]) as the graph runner stages them: the real
    rows' dense table, then padding rows (one token on the padding page)."""
    _, seq, table = decode_table(starts, tables, page_size)
    b, w = table.shape
    seqs = torch.ones(bs, dtype=torch.int32)
    seqs[:b] = torch.from_numpy(seq)
    full = torch.full((bs, w), PAD_PAGE, dtype=torch.int32)
    full[:b] = torch.from_numpy(table)
    return seqs, full


def _padded(starts: list[int], page_size: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    return staged(starts, _tables(starts, page_size), page_size, bs)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("starts", BATCHES)
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("tokens", [bi.TOKENS, 4, 1])
def test_device_blocks_equal_the_plan(starts: list[int], page_size: int, pad: int, tokens: int) -> None:
    bs = len(starts) + pad
    seqs, table = _padded(starts, page_size, bs)
    want = bi.plan(table, seqs.tolist(), [1] * bs, page_size, kernel=True, tokens=tokens)
    got = bi.DecodeBlocks(64, "cpu", tokens).fill(seqs, page_size)
    order = want.blocks[0].argsort(stable=True)  # plan: most chunks first; the graph: row order
    assert [t.dtype for t in got] == [t.dtype for t in want.blocks]
    for g, w in zip(got, want.blocks, strict=True):
        assert g.is_contiguous() and torch.equal(g, w[order])
    assert want.chunk == bi.kv_chunk(page_size)


def test_fill_reuses_its_buffers() -> None:
    """A replay rewrites the same storage (the captured kernel's pointers) for any batch."""
    blocks = bi.DecodeBlocks(8, "cpu")
    first = blocks.fill(torch.tensor([70, 1], dtype=torch.int32), 16)
    second = blocks.fill(torch.tensor([5, 129, 64], dtype=torch.int32), 16)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, second, strict=True))
    assert second[3].tolist() == [1, 3, 1] and second[2][:, 0].tolist() == [4, 128, 63]


def _pool(page_size: int = 16) -> KVPool:
    return KVPool(2, 64, page_size, 2, 32, torch.float32, "cpu")


def test_torch_backend_is_captured_only_with_the_kernel() -> None:
    """On the CPU (no kernel) the torch backend stays uncaptured, with the mode on or off."""
    for on in (False, True):
        bi.enable(on, "cpu")
        backend = TorchAttention("cpu")
        backend.bind(num_q_heads=4, kv_pool=_pool(), max_batch=8, max_pages_per_req=5)
        assert backend.supports_cuda_graph is False
    assert TorchAttention.supports_cuda_graph is False


def test_graph_table_clears_stale_columns_and_prepare_leaves_graphs() -> None:
    """set_graph_table: a narrower step after a wider one reads the padding page past its width
    (as an eager batch's table does), its padding rows one token on the padding page; an eager
    step's prepare drops the graph state."""
    bi.enable(True, "cpu")
    backend = TorchAttention("cpu")
    backend.bind(num_q_heads=4, kv_pool=_pool(), max_batch=8, max_pages_per_req=6)
    backend.bind_graphs(8, 6)
    assert backend.uses_table(8) and backend._g_indices.numel() == 48
    backend.graph_wrapper(8)
    assert torch.equal(backend._graph[0], torch.full((8, 6), PAD_PAGE, dtype=torch.int32))
    wide = torch.arange(1, 25, dtype=torch.int32).view(4, 6)
    backend.set_graph_table(4, torch.full((4,), 90, dtype=torch.int32), wide)
    seqs, narrow = _padded([20, 3], 16, 4)
    backend.set_graph_table(4, seqs, narrow)
    table, lens = backend._graph
    assert table.shape == (4, 6) and torch.equal(lens, seqs)
    assert torch.equal(table[:, : narrow.shape[1]], narrow) and not table[:, narrow.shape[1]:].any()
    from engine.layers.forward import ForwardBatch

    batch = ForwardBatch.build([5, 6], [20, 3], [1, 1], _tables([20, 3], 16), [1, 1], 16, "cpu")
    backend.prepare(batch)
    assert backend._graph is None and (backend._invariant is not None or backend._cpu_plan is not None)
