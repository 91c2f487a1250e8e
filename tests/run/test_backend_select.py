"""Backend selection, CUDA-graph batch padding and flashinfer metadata: the CPU-testable parts
of the GPU path (no flashinfer import, no CUDA)."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from engine.config import ServerConfig
from engine.layers.attention import TorchAttention, available_backends, create_backend, resolve_backend_name
from engine.layers.flashinfer_attention import pad_metadata, paged_kv_metadata
from engine.layers.forward import ForwardBatch
from engine.run.cuda_graph import capture_sizes, padded_batch_size


def test_auto_is_torch_on_cpu() -> None:
    assert isinstance(create_backend("auto", "cpu"), TorchAttention)
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", "cuda") == "flashinfer"
    assert "flashinfer" in available_backends()


def test_flashinfer_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="not available on cpu.*needs a CUDA device.*--attention-backend torch"):
        create_backend("flashinfer", "cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        resolve_backend_name("flashinfer", "cpu")
    # the worker's choice names the device before the dtype (flashinfer's float32 gap is the second problem)
    from engine.config import ServerConfig
    from engine.layers.kv_layout import KVLayout
    from engine.run.assembly import backend_name

    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        backend_name(ServerConfig(attention_backend="flashinfer", device="cpu"), False, KVLayout.gqa(2, 8),
                     torch.float32)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("flash", "cpu")


def test_cpu_path_never_imports_flashinfer() -> None:
    create_backend("auto", "cpu")
    assert "flashinfer" not in sys.modules


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    s = capture_sizes(512)
    assert s[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert s[-1] == 512 and s == sorted(set(s))
    assert 256 in s and 320 in s
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("batch", "want"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64), (64, 64)]
)
def test_padding_goes_to_next_captured_size(batch: int, want: int) -> None:
    assert padded_batch_size(batch, capture_sizes(64)) == want


def test_padding_beyond_largest_is_eager() -> None:
    assert padded_batch_size(65, capture_sizes(64)) is None
    assert padded_batch_size(7, capture_sizes(7)) == 7
    with pytest.raises(ValueError):
        padded_batch_size(0, [1, 2])


def test_paged_kv_metadata_from_page_table() -> None:
    # page size 4: request 0 has 5 tokens (2 pages), request 1 has 4 (1 page), request 2 has 9 (3)
    batch = ForwardBatch.from_requests(
        [([1, 2], 3, [7, 3]), ([5], 3, [9]), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 0, [4, 5, 6])], 4, "cpu"
    )
    indptr, indices, last = paged_kv_metadata(batch.seq_lens_cpu, batch.page_table_cpu, 4)
    assert indptr.tolist() == [0, 2, 3, 6]
    assert indices.tolist() == [7, 3, 9, 4, 5, 6]
    assert last.tolist() == [1, 4, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_pad_metadata_points_padding_rows_at_page_zero() -> None:
    indptr, indices, last = pad_metadata(
        torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([7, 3, 9], dtype=torch.int32),
        torch.tensor([1, 4], dtype=torch.int32), 2,
    )
    assert indptr.tolist() == [0, 2, 3, 4, 5]
    assert indices.tolist() == [7, 3, 9, 0, 0]
    assert last.tolist() == [1, 4, 1, 1]


def test_forward_batch_keeps_cpu_page_table() -> None:
    batch = ForwardBatch.from_requests([([1, 2, 3], 0, [2, 8]), ([4], 5, [3, 6, 9])], 4, "cpu")
    assert batch.page_table_cpu.tolist() == [[2, 0], [3, 6]]  # the pages each length needs, padded
    assert batch.page_table is batch.page_table_cpu  # on CPU no copy is made
    with pytest.raises(ValueError, match="request 1: page table uses the reserved padding page"):
        ForwardBatch.from_requests([([1], 0, [5]), ([1], 4, [7, 0])], 4, "cpu")


def test_decode_metadata_matches_forward_batch() -> None:
    from engine.run.cuda_graph import decode_metadata, decode_out_slots

    rng = random.Random(3)
    ps = 4
    tables, starts = [], []
    for _ in range(7):
        start = rng.randrange(0, 40)
        n = start // ps + 1
        tables.append(rng.sample(range(1, 500), n + rng.randrange(0, 3)))  # may be longer than needed
        starts.append(start)
    batch = ForwardBatch.build([1] * 7, starts, [1] * 7, tables, [1] * 7, ps, "cpu")
    out_slots, indptr, indices, last = decode_metadata(starts, tables, ps)
    want = paged_kv_metadata(batch.seq_lens_cpu, batch.page_table_cpu, ps)
    assert out_slots.tolist() == batch.out_slots.tolist()
    assert decode_out_slots(starts, tables, ps).tolist() == out_slots.tolist()  # context parallelism's runner
    assert indptr.tolist() == want[0].tolist()
    assert indices.tolist() == want[1].tolist()
    assert last.tolist() == want[2].tolist()
    with pytest.raises(ValueError, match="padding page"):
        decode_metadata([5], [[3, 0]], ps)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_metadata([5], [[3]], ps)
    for bad in ([[3, 0]], [[3]]):
        with pytest.raises(ValueError, match="padding page"):
            decode_out_slots([5], bad, ps)


def test_attention_fp8_math_needs_an_fp8_kv_cache() -> None:
    from engine.args import parse_args

    with pytest.raises(ValueError, match="needs --kv-cache-dtype fp8_e4m3"):
        ServerConfig(attention_fp8_math=True)
    cfg = parse_args(["--kv-cache-dtype", "fp8_e4m3", "--attention-fp8-math"])
    assert cfg.attention_fp8_math and cfg.kv_cache_dtype == "fp8_e4m3"
