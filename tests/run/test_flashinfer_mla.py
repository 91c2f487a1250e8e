"""The pure-Python parts of serving flashinfer's MLA decode (engine/layers/flashinfer_mla.py), on
the CPU: the tuning rule that chooses it, and the metadata its plan is given (an eager step's, from
the dense CPU page table; a replay's, from the graph runner's padded indptr / last page lengths),
checked by attending through that metadata the way flashinfer's kernel reads it (pages
kv_indices[kv_indptr[i]:kv_indptr[i+1]], the first kv_len[i] tokens) against our torch absorbed
path over the dense table. The kernel itself is tests/gpu/test_mla_flashinfer_gpu.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.layers.flashinfer_mla import eager_metadata, flashinfer_mla_supported, graph_kv_lens
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import PAD_PAGE, KVPool
from engine.layers.mla_attention import MLABackend, MLAPlan, MLAShapes, mla_attend
from engine.layers.tuning import DEFAULT, load_tuning, parse_tuning
from engine.run.cuda_graph import decode_metadata

R, P, NOPE, V, H = 32, 16, 8, 12, 4  # tiny latent: the metadata does not depend on the geometry


def test_tuning_rule_serves_flashinfer_from_64_heads_on_h200() -> None:
    """The H200 file's rule (its figures in the file's _mla_decode): flashinfer at >= 64 heads where
    it takes the rank; ours below, where unsupported, and on a GPU without a file."""
    h200 = load_tuning("NVIDIA H200")
    assert h200.mla_flashinfer_min_heads == 64
    assert [h200.mla_decode_kernel(h, True) for h in (128, 64, 63, 16, 8)] == \
        ["flashinfer", "flashinfer", "triton", "triton", "triton"]
    assert h200.mla_decode_kernel(128, False) == "triton"
    assert DEFAULT.mla_flashinfer_min_heads == 0 and DEFAULT.mla_decode_kernel(128, True) == "triton"
    assert parse_tuning({"mla_flashinfer_min_heads": 32}, "x").mla_decode_kernel(32, True) == "flashinfer"
    for bad in (-1, 1.5, "64"):
        with pytest.raises(ValueError, match="mla_flashinfer_min_heads"):
            parse_tuning({"mla_flashinfer_min_heads": bad}, "x")


def test_cpu_backend_keeps_the_dense_table_protocol() -> None:
    """Off CUDA flashinfer is never chosen: the backend stays on the dense-table protocol."""
    assert not flashinfer_mla_supported(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 576)
    kv = KVPool.from_layout(KVLayout.latent(512, 64), 1, 4, 16, torch.bfloat16, "cpu")
    backend = MLABackend("cpu")
    backend.bind(num_q_heads=128, kv_pool=kv, max_batch=4, max_pages_per_req=2)
    assert backend.kernel == "triton" and backend.fi is None and backend.uses_table(4)


def _tables(lens: list[int], ps: int, pages: int, seed: int) -> list[list[int]]:
    free = list(range(1, pages))
    random.Random(seed).shuffle(free)  # non-contiguous pages
    return [[free.pop() for _ in range(-(-n // ps))] for n in lens]


def _paged_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, indptr: torch.Tensor,
                     indices: torch.Tensor, kv_len: torch.Tensor, ps: int, scale: float) -> torch.Tensor:
    """o_lat [b, H, R] as flashinfer's MLA kernel reads its plan: row i attends the first kv_len[i]
    tokens of pages indices[indptr[i]:indptr[i+1]] (non-causal decode), lat [slots, 1, R + P]."""
    out = []
    for i in range(q_lat.shape[0]):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[: int(kv_len[i])]
        kv = lat[slots, 0].float()
        q = torch.cat([q_lat[i], q_pe[i]], -1).float()
        out.append((q @ kv.T * scale).softmax(-1) @ kv[:, :R])
    return torch.stack(out)


def _case(lens: list[int], ps: int, seed: int):  # noqa: ANN202
    pages = sum(-(-n // ps) for n in lens) + 3
    tables = _tables(lens, ps, pages, seed)
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, pages, ps, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    kv.latent[0].copy_(torch.randn(kv.latent[0].shape, generator=g))
    q_nope, q_pe = torch.randn(len(lens), H, NOPE, generator=g), torch.randn(len(lens), H, P, generator=g)
    w = torch.randn(H * (NOPE + V), R, generator=g) * 0.3
    s = MLAShapes(H, R, NOPE, P, V, (NOPE + P) ** -0.5)
    return tables, kv, q_nope, q_pe, w, s


def _through_metadata(q_nope, q_pe, w, s, kv, indptr, indices, kv_len, ps):  # noqa: ANN001, ANN202
    wv = w.view(H, NOPE + V, R)
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope, wv[:, :NOPE])
    o_lat = _paged_reference(q_lat, q_pe, kv.latent[0], indptr, indices, kv_len, ps, s.scale)
    return torch.einsum("bhr,hvr->bhv", o_lat, wv[:, NOPE:])


@pytest.mark.parametrize(("ps", "lens"), [(4, [1, 7, 8, 33, 2]), (16, [16, 17, 250])])
def test_eager_metadata_attends_like_the_dense_table(ps: int, lens: list[int]) -> None:
    """An eager step's plan (MLABackend.prepare -> eager_metadata) from the CPU page table, padded
    wider than any row needs: the same pages in the same order as a brute-force walk, lengths in
    tokens, and attending through it equals our torch path over the dense table."""
    tables, kv, q_nope, q_pe, w, s = _case(lens, ps, seed=ps)
    batch = ForwardBatch.from_requests([([3], n - 1, t) for n, t in zip(lens, tables, strict=True)], ps, "cpu")
    wide = torch.full((len(lens), batch.page_table_cpu.shape[1] + 2), 77, dtype=torch.int32)  # never read
    wide[:, : batch.page_table_cpu.shape[1]] = batch.page_table_cpu
    qo, indptr, indices, kv_len = eager_metadata(batch.seq_lens_cpu, wide, ps)
    assert all(t.dtype == torch.int32 for t in (qo, indptr, indices, kv_len))
    assert qo.tolist() == list(range(len(lens) + 1)) and kv_len.tolist() == lens
    assert indptr.tolist() == np.cumsum([0] + [len(t) for t in tables]).tolist()
    assert indices.tolist() == [p for t in tables for p in t]
    want = mla_attend(q_nope, q_pe, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    got = _through_metadata(q_nope, q_pe, w, s, kv, indptr, indices, kv_len, ps)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_graph_plan_lengths_from_the_runners_padded_metadata() -> None:
    """A replay's plan (MLABackend.plan_graph_arrays): the KV lengths rebuilt from the indptr and
    last page lengths engine/run/cuda_graph.py's run_decode stages (3 requests padded to 5: each
    padding row one token on the padding page) are each row's position + 1, and 1 for padding;
    attending through them gives the real rows our torch path's outputs."""
    ps, starts, bs = 4, [6, 12, 0], 5
    lens = [st + 1 for st in starts]
    tables, kv, q_nope, q_pe, w, s = _case(lens, ps, seed=3)
    _, indptr, indices, last = decode_metadata(starts, tables, ps)
    b, nnz = len(starts), int(indptr[-1])
    # as run_decode fills its pinned buffer past the real rows
    indptr = np.concatenate([indptr, nnz + np.arange(1, bs - b + 1, dtype=np.int32)])
    last = np.concatenate([last, np.ones(bs - b, dtype=np.int32)])
    indices = np.concatenate([indices, np.full(bs - b, PAD_PAGE, dtype=np.int32)])
    out = torch.full((bs,), -5, dtype=torch.int32)
    kv_len = graph_kv_lens(torch.from_numpy(indptr), torch.from_numpy(last), ps, out)
    assert kv_len is out and kv_len.tolist() == [*lens, 1, 1]
    batch = ForwardBatch.from_requests([([3], st, t) for st, t in zip(starts, tables, strict=True)], ps, "cpu")
    want = mla_attend(q_nope, q_pe, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    pad = lambda x: torch.cat([x, x[:1].expand(bs - b, *x.shape[1:])])  # noqa: E731 - padding rows' queries
    got = _through_metadata(pad(q_nope), pad(q_pe), w, s, kv, torch.from_numpy(indptr), torch.from_numpy(indices),
                            kv_len, ps)
    torch.testing.assert_close(got[:b], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got[b:]).all()  # the padding rows read the padding page only
