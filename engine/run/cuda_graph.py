"""CUDA graphs for decode steps.

After warm-up, the model's forward is captured once per batch size in `capture_sizes(max)`
(1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to 256, then every 64; the largest is
max_running_requests). A decode batch of size b replays the graph of the next captured size:
its rows are copied into static buffers (input ids, positions, KV slots) and the rows past b
are padding (token 0 at position 0, writing its K/V into slot 0 of the padding page 0, and
attending to that page only). The attention backend re-plans its fixed-size decode wrapper
for the real page tables before each replay. Logits come back sliced to the real rows;
sampling runs right after the replay, outside the graph.

Decode steps replay through `run_decode` (the only replay path), a lean host path: the step's metadata is built
from the Step's Python lists with numpy (`decode_metadata`), staged in two alternating pinned
buffers and sent with two host-to-device copies (ids/positions/slots, page indices); no
ForwardBatch and no per-step torch CPU ops. Future references (-1 ids) resolve on the device.

The size helpers and decode_metadata are pure Python (tested on CPU); CudaGraphRunner needs a
CUDA device and a backend with `supports_cuda_graph` (flashinfer; MLABackend; the torch backend
under deterministic inference where its invariant kernel runs; context parallelism's, which plans
its rank's own pages from the step's lists: `plans_from_lists`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import structlog
import torch

from engine.layers.forward import ForwardBatch, gather_pages
from engine.layers.kv_pool import PAD_PAGE

log = structlog.get_logger()

_SMALL_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture for a server running at most `max_batch` requests (ascending,
    ending with max_batch itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in _SMALL_SIZES if s < max_batch]
    nxt = 96
    while nxt < max_batch:
        sizes.append(nxt)
        nxt += 32 if nxt < 256 else 64
    sizes.append(max_batch)
    return sizes


def padded_batch_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch, or None when batch exceeds them all (eager)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def _decode_pages(
    starts: Sequence[int], tables: Sequence[Sequence[int]], page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seq_lens int64 [B], pages per request int64 [B], their pages flattened int32 [nnz],
    out_slots int64 [B]) of a decode batch; raises ValueError when a table is too short or
    uses the padding page."""
    st = np.asarray(starts, dtype=np.int64)
    seq = st + 1
    npages = (seq + (page_size - 1)) // page_size
    counts = npages.tolist()
    for i, (t, n) in enumerate(zip(tables, counts, strict=True)):
        if len(t) < n:
            raise _no_room(i, t, n)
    indices = gather_pages(tables, counts)
    last_page = indices[np.cumsum(npages) - 1].astype(np.int64)
    return seq, npages, indices, last_page * page_size + st % page_size


def _no_room(i: int, table: Sequence[int], pages: int) -> ValueError:
    return ValueError(f"request {i}: page table {list(table[:pages])} cannot hold {pages} pages off the padding page")


def decode_out_slots(starts: Sequence[int], tables: Sequence[Sequence[int]], page_size: int) -> np.ndarray:
    """The out_slots of decode_metadata alone (int64 [B]), reading each table's last page only;
    raises ValueError when a table is too short or that page is the padding page."""
    pages = [s // page_size for s in starts]
    for i, (t, p) in enumerate(zip(tables, pages, strict=True)):
        if len(t) <= p or t[p] == PAD_PAGE:
            raise _no_room(i, t, p + 1)
    last = np.fromiter((t[p] for t, p in zip(tables, pages, strict=True)), dtype=np.int64, count=len(pages))
    return last * page_size + np.asarray(starts, dtype=np.int64) % page_size


def decode_metadata(
    starts: Sequence[int], tables: Sequence[Sequence[int]], page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For a decode batch (one new token per request at position starts[i], written through
    page table tables[i]): (out_slots int64 [B], kv_indptr int32 [B+1], kv_indices int32 [nnz],
    kv_last_page_len int32 [B]), the same values ForwardBatch.build and paged_kv_metadata give.
    Raises ValueError when a table is too short or uses the padding page."""
    seq, npages, indices, out_slots = _decode_pages(starts, tables, page_size)
    indptr = np.zeros(len(npages) + 1, dtype=np.int32)
    np.cumsum(npages, out=indptr[1:])
    last = (seq - (npages - 1) * page_size).astype(np.int32)
    return out_slots, indptr, indices, last


def decode_table(
    starts: Sequence[int], tables: Sequence[Sequence[int]], page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a decode batch as in decode_metadata: (out_slots int64 [B], seq_lens int32 [B],
    page table int32 [B, W]) with W the most pages any request needs, rows padded with the
    padding page (the dense form XQA reads). Raises ValueError like decode_metadata."""
    seq, npages, indices, out_slots = _decode_pages(starts, tables, page_size)
    table = np.full((len(npages), int(npages.max())), PAD_PAGE, dtype=np.int32)
    table[np.arange(table.shape[1])[None, :] < npages[:, None]] = indices  # row-major: request order
    return out_slots, seq.astype(np.int32), table


class _Pinned:
    """Two pinned host staging sets used alternately; one is refilled only after the copies
    that read it (recorded by an event) are done. At most two steps are ever in flight."""

    def __init__(self, n: int, n_indices: int) -> None:
        self.i64 = [torch.zeros(4, n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.i32 = [torch.zeros(2 * n + 1 + n_indices, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.i = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i ^= 1
        ev = self.events[self.i]
        if ev is not None:
            ev.synchronize()
        return self.i64[self.i], self.i32[self.i]

    def release(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.i] = ev


class GraphOutputs(Protocol):
    """Tensors that forward hooks compute (engine/run/eagle.py: HiddenTap): a replay runs no
    hook, so what the hooks computed while a graph was captured becomes that graph's output."""

    def captured(self, bs: int) -> None:
        """The graph of `bs` rows was just captured: keep what the hooks computed in it."""

    def replayed(self, bs: int, rows: int) -> None:
        """That graph was just replayed for its first `rows` rows: hand its outputs out."""


class CudaGraphRunner:
    """Captures and replays the decode forward of `model` (see the module docstring)."""

    def __init__(self, model, kv_pool, backend, max_batch: int, device: torch.device,  # noqa: ANN001
                 outputs_of: GraphOutputs | None = None) -> None:
        if not getattr(backend, "supports_cuda_graph", False):
            raise ValueError(f"{type(backend).__name__} cannot be captured in a CUDA graph")
        self.model, self.kv, self.backend = model, kv_pool, backend
        self.outputs_of = outputs_of  # forward hooks' results, handed out after each replay
        self.device = torch.device(device)
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        # static inputs: padding rows keep token 0, position 0 and slot PAD_PAGE*page_size (0).
        # meta rows: raw ids (-1 = future reference), positions, out slots, request slots
        self.meta = torch.zeros(4, n, dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions, self.out_slots, self.slots = self.meta[1], self.meta[2], self.meta[3]
        self.rows = torch.arange(n, dtype=torch.int64, device=self.device)
        # Made here, before ready: made on the first served decode step, their cudaHostAlloc
        # (2 x 2.6 MB) held the compute stream until the host tier's queued backups drained
        # (27 ms in an H200 profile).
        self._pinned = _Pinned(n, backend._g_indices.numel())
        self._dev_i32 = torch.zeros_like(self._pinned.i32[0], device=self.device)  # its device twin
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._batches: dict[int, ForwardBatch] = {}  # keeps each captured batch's tensors alive
        self.pool = None
        self.capture_s = 0.0
        self.capture_bytes = 0
        self.replays = 0

    def _static_batch(self, bs: int) -> ForwardBatch:
        ps = self.kv.page_size
        pad_table = torch.full((bs, 1), PAD_PAGE, dtype=torch.int32)
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            page_table=pad_table.to(self.device),
            seq_lens=torch.ones(bs, dtype=torch.int32, device=self.device),
            extend_lens=torch.ones(bs, dtype=torch.int32, device=self.device),
            logit_indices=self.rows[:bs],
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
            page_size=ps,
            is_decode=True,
            page_table_cpu=pad_table,
        )

    def capture(self) -> None:
        """Warm up and capture every size, largest first (smaller graphs reuse its pool)."""
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(device=self.device)
        for bs in reversed(self.sizes):
            batch = self._static_batch(bs)
            self._batches[bs] = batch
            self.backend.graph_wrapper(bs)  # planned with dummy rows on the padding page
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits, kernel JIT/autotune, cuBLAS workspaces
                    self.model(batch, self.kv, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.model(batch, self.kv, self.backend)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
            if self.outputs_of is not None:
                self.outputs_of.captured(bs)
        # ready means warm: a graph's first replay does work of its own (its upload); replay
        # each once now, on the padding rows it was captured with
        for bs in self.sizes:
            self.graphs[bs].replay()
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        log.info(
            "cuda graphs captured", sizes=self.sizes, seconds=round(self.capture_s, 2),
            mib=round(self.capture_bytes / 2**20, 1),
        )

    def run_decode(
        self,
        ids: Sequence[int],
        slots: Sequence[int],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        last_token: torch.Tensor | None,
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay a decode step given the Step's lists: request i (slot slots[i]) feeds token
        ids[i] (-1: last_token[slots[i]]) at position starts[i]; `device_ids` [B], when given,
        are the tokens instead (a draft head following the target: engine/run/eagle.py). Returns
        the graph's output rows [B, ...] (the model's float32 logits; a view, valid until the
        next replay)."""
        b = len(slots)
        bs = padded_batch_size(b, self.sizes)
        if bs is None:
            raise ValueError(f"decode batch {b} exceeds the largest captured size {self.max_batch}")
        ps = self.kv.page_size
        h64, h32 = self._pinned.take()
        dense = self.backend.uses_table(bs)
        by_lists = getattr(self.backend, "plans_from_lists", False)  # context parallelism: its own pages' table
        if dense:
            out_slots, seq, table = decode_table(starts, tables, ps)
        elif by_lists:  # the backend reads the lists itself (plan_graph_lists)
            out_slots = decode_out_slots(starts, tables, ps)
        else:
            out_slots, indptr, indices, last = decode_metadata(starts, tables, ps)
        m = h64.numpy()
        m[0, :b], m[1, :b], m[2, :b], m[3, :b] = ids, starts, out_slots, slots
        m[:, b:bs] = 0  # padding rows: token 0 at position 0, written into the padding page
        m[2, b:bs] = PAD_PAGE * ps
        self.meta.copy_(h64, non_blocking=True)
        n = self.max_batch
        a = h32.numpy()
        if dense:  # [0, bs): KV lengths; [n, n + bs*w): the dense page table
            w = table.shape[1]
            a[:b], a[b:bs] = seq, 1
            t = a[n : n + bs * w].reshape(bs, w)
            t[:b], t[b:] = table, PAD_PAGE
            dev = self._dev_i32[: n + bs * w]
            dev.copy_(h32[: n + bs * w], non_blocking=True)
            self.backend.set_graph_table(bs, dev[:bs], dev[n:].view(bs, w))
        elif not by_lists:  # [0, bs+1): kv_indptr; [n+1, n+1+bs): last page lengths; [2n+1, ...): page indices
            nnz, pad = int(indptr[-1]), bs - b
            a[: b + 1] = indptr
            a[b + 1 : bs + 1] = nnz + np.arange(1, pad + 1, dtype=np.int32)
            a[n + 1 : n + 1 + b] = last
            a[n + 1 + b : n + 1 + bs] = 1
            off = 2 * n + 1
            a[off : off + nnz] = indices
            a[off + nnz : off + nnz + pad] = PAD_PAGE
            g_indices = self._dev_i32[off : off + nnz + pad]  # the plan copies them into the wrapper's buffer
            g_indices.copy_(h32[off : off + nnz + pad], non_blocking=True)
        if device_ids is not None:
            self.input_ids[:b].copy_(device_ids)
            self.input_ids[b:bs].zero_()
        elif min(ids) < 0:
            assert last_token is not None, "future references need the slots' last tokens"
            self._resolve_future(bs, last_token)
        else:
            self.input_ids[:bs].copy_(self.meta[0, :bs])
        if by_lists:
            self.backend.plan_graph_lists(bs, starts, tables)
        elif not dense:
            self.backend.plan_graph_arrays(bs, h32[: bs + 1], h32[n + 1 : n + 1 + bs], g_indices)
        self._pinned.release()
        self.graphs[bs].replay()
        self.replays += 1
        if self.outputs_of is not None:
            self.outputs_of.replayed(bs, b)
        return self.outputs[bs][:b]

    def _resolve_future(self, bs: int, last_token: torch.Tensor) -> None:
        """input ids of rows :bs from meta, future references (-1) read from last_token[slot]."""
        raw = self.meta[0, :bs]
        torch.where(raw < 0, last_token[self.meta[3, :bs]], raw, out=self.input_ids[:bs])

    def warm_future_refs(self, last_token: torch.Tensor) -> None:
        """Run the future-reference path once before serving (row 0 stays padding: token 0).
        Only overlapped steps take it, and its kernels load lazily on first use: the first
        overlapped decode step stalled 25-50 ms on an H200 without this."""
        self._resolve_future(1, last_token)
