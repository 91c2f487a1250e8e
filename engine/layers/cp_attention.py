"""Context parallelism at the model level: each KV page lives on one cp rank, attention is merged
by log-sum-exp (docs/architecture.md, "Context parallelism").

* **Ownership** (`page_owner`): a request's i-th page (positions i*page_size ..) belongs to rank
  i % cp. A pure function of the page's index in its request, so every replica (and the scheduler)
  agrees without a message, and a cached prefix keeps its owners when another request reuses it
  (a shared page has the same index in both). One page table serves every rank: entry i is the
  global id `local * cp + owner` of a page in the pool of rank page_owner(i) (the scheduler's
  engine/cache/allocator.OwnedPageAllocator); a rank reads and writes only its own entries, at
  local id = global // cp.
* **Writes**: a new token's K/V is stored by the owner of its page only.
* **Attention** for request i with cached prefix [0, start) and new tokens [start, seq_len):
  - prefix part: every new query over this rank's own pages' cached keys (no mask: all of them
    precede every query);
  - self part: this rank's zigzag share of the new query rows (`zigzag_rows`) over the step's
    new keys, causal. Every rank holds every new token's K/V this step (the projections are
    replicated), so the causal triangle needs no exchange and is split evenly by the zigzag.
  Each part returns (output, LSE) in float32; a rank merges its parts, then one all-gather over
  the cp group per layer carries [T, Hq, D + 1] (output | LSE) and every rank merges the cp
  partials in rank order, so every rank ends with the same bytes.
  A decode row (one new token) is the same case: its prefix over every rank's own pages, its
  own key on rank 0. The step's one-token rows instead go in one kernel call (`_Decode`): the
  owner has stored the new key first, so each rank attends its own pages, the new key among them,
  as one paged decode over a local page table, with the kernel's LSE (CPU: cpu_attention.c; CUDA:
  flashinfer's paged decode, whose LSE is base 2).
* **Deterministic inference** (`plan_step(per_row=True)`, CPU only: assembly.check_context_parallel
  refuses the rest): every new row, prefill rows too, is such a decode row of its own over this
  rank's keys up to its position, so its bits do not depend on what was cached, the chunks or
  the batch.
* **CUDA graphs** (decode steps, engine/run/cuda_graph.py): the graph runner hands the step's lists
  to `plan_graph_lists`, which plans a fixed-size flashinfer decode over this rank's pages
  (`local_decode_metadata`: a row with no key here, or a padding row, reads the padding page and
  its LSE is set to -inf); inside the graph the owner test and the local slots are computed on the
  device from the static positions and slots (a row this rank does not own writes the padding
  page), and the all-gather (NCCL) is captured with the rest of the layer.
* Kernels: the partials and their merge are engine/layers/lse_attention.py's. cp = 1 never builds
  this backend (`context_parallel` returns the plain one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.layers import batch_invariant, cpu_attention
from engine.layers.attention import AttentionBackend
from engine.layers.flashinfer_attention import _INT_WORKSPACE_BYTES, _Staging
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import PAD_PAGE, KVPool
from engine.layers.lse_attention import attend_all, causal_tail, flash_available, merge_partials
from engine.layers.parallel import TPGroup, parallel_state, range_split

_LN2 = 0.6931471805599453  # flashinfer's LSE is base 2


def page_owner(page_index: int, cp_world: int) -> int:
    """The cp rank that holds a request's page number `page_index` (0 = its first page): round
    robin over the request's pages, so a long context spreads evenly and every rank's share of
    any causal prefix is within one page of 1/cp."""
    if cp_world < 1 or page_index < 0:
        raise ValueError(f"page_owner: page index {page_index} and cp world {cp_world} must be >= 0 and >= 1")
    return page_index % cp_world


def zigzag_rows(n: int, cp_world: int, rank: int) -> list[tuple[int, int]]:
    """Rank's share of n new query rows for the causal part: [0, n) cut into 2 * cp chunks, the
    rank taking chunk `rank` and chunk 2 * cp - 1 - rank (one early, cheap; one late, costly), so
    each rank's causal work (sum of row + 1) is even. Empty ranges are left out."""
    parts = 2 * cp_world
    chunks = (range_split(n, parts, rank), range_split(n, parts, parts - 1 - rank))
    return [c for c in chunks if c[1] > c[0]]


def own_decode_pages(seq: int, page_size: int, rank: int, world: int) -> tuple[range, int]:
    """A decode row with `seq` keys (its new one included): the indices of its pages that `rank`
    owns, in order, and how many keys they hold (the request's last page may be part full)."""
    used = -(-seq // page_size)
    mine = range(rank, used, world)
    keys = len(mine) * page_size - (page_size * used - seq if mine and mine[-1] == used - 1 else 0)
    return mine, keys


def local_decode_metadata(starts: Sequence[int], tables: Sequence[Sequence[int]], page_size: int, rank: int,
                          world: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flashinfer's paged-decode metadata (kv_indptr int32 [rows + 1], kv_indices int32, kv_last_page_len
    int32 [rows]) of a decode batch over this rank's pages: request i (new token at starts[i], global
    page table tables[i]) attends its own pages at their local ids (global // world). A request with
    no page here, and the padding rows len(starts) .. rows, read one key of the padding page instead
    (their LSE is set to -inf after the kernel)."""
    counts = np.ones(rows, dtype=np.int32)
    last = np.ones(rows, dtype=np.int32)
    parts: list[Sequence[int]] = []
    for i, (s, t) in enumerate(zip(starts, tables, strict=True)):
        mine, keys = own_decode_pages(s + 1, page_size, rank, world)
        if not mine:
            parts.append((PAD_PAGE,))
            continue
        parts.append(t[mine.start : mine.stop : world])
        counts[i] = len(mine)
        last[i] = keys - (len(mine) - 1) * page_size
    indptr = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.full(int(indptr[-1]), PAD_PAGE, dtype=np.int32)
    n = int(indptr[len(parts)])
    indices[:n] = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=n) // world
    return indptr, indices, last


@dataclass
class _ReqPlan:
    """One request's work on this rank (rows of T, pages of the pool)."""

    row: int  # its first row in T
    n: int  # its new tokens
    prefix_pages: torch.Tensor | None  # int64 [1, m]: this rank's pages holding cached positions
    prefix_keys: int  # how many of those pages' gathered rows are cached positions (< start)
    self_rows: list[tuple[int, int]]  # its zigzag rows (relative to row) for the causal part


@dataclass
class _Decode:
    """The step's one-token rows that have keys on this rank, as one paged decode over this rank's
    pool: request j's own pages in order (local ids) hold its lens[j] keys, the new one among them
    where this rank owns its page (stored before attention)."""

    reqs: list[int]  # their indices in the batch (`_every_row`: their rows)
    rows: torch.Tensor  # int64: their rows of T
    pages: list[torch.Tensor]  # int64: each one's local page ids, in order
    lens: list[int]  # keys on this rank
    kernel: cpu_attention.Plan | None = None  # CPU: built on first use (it needs the KV heads)
    planned: bool = False  # CUDA: flashinfer's decode wrapper planned for this step

    def table(self) -> torch.Tensor:
        """int64 [len(reqs), width]: the local page table (rows padded with page 0)."""
        out = torch.zeros(len(self.pages), max(len(p) for p in self.pages), dtype=torch.int64)
        for j, p in enumerate(self.pages):
            out[j, : len(p)] = p
        return out

    def paged_metadata(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """flashinfer's (kv_indptr, kv_indices, kv_last_page_len), int32 on the CPU."""
        counts = torch.tensor([len(p) for p in self.pages], dtype=torch.int32)
        indptr = torch.zeros(len(self.pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(counts, 0)
        last = torch.tensor(self.lens, dtype=torch.int32) - (counts - 1) * page_size
        return indptr, torch.cat(self.pages).to(torch.int32), last


@dataclass
class _Plan:
    own_rows: torch.Tensor  # int64: rows of T whose K/V this rank stores (their page is its own)
    own_slots: torch.Tensor  # int64: where (this rank's pool)
    reqs: list[_ReqPlan]
    decode: _Decode | None = None  # the one-token rows, where one kernel call attends them (CPU)
    # deterministic inference: `decode` holds every row, each attending its own keys as a decode row
    per_row: bool = False


def plan_step(batch: ForwardBatch, rank: int, world: int, per_row: bool = False) -> _Plan:
    """This rank's share of a step: which new K/V it writes, which cached pages and new rows it
    attends. per_row (deterministic inference): every new row attends, as one decode row, this
    rank's keys up to its own position, read back from the pool (its page's owner stored it first):
    a row's partial is then a function of its position and the pages alone, whatever part of the
    prompt was cached, how it was chunked, or what else the step holds (`_every_row`)."""
    ps = batch.page_size
    # positions from the host lists (no device sync): request i's new tokens are at start..seq-1
    pos = torch.cat([torch.arange(s - n, s) for s, n in zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True)])
    own = torch.nonzero((pos // ps) % world == rank).flatten()
    table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table.cpu()
    reqs, row = [], 0
    for i, (seq, n) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True)):
        start = seq - n
        cached_pages = -(-start // ps)
        mine = [j for j in range(cached_pages) if page_owner(j, world) == rank]
        pages, keys = None, 0
        if mine:
            pages = (table[i, mine].to(torch.int64) // world)[None].to(batch.page_table.device)
            keys = len(mine) * ps
            if mine[-1] == cached_pages - 1:  # the last cached page may also hold new tokens
                keys -= cached_pages * ps - start
        reqs.append(_ReqPlan(row, n, pages, keys, zigzag_rows(n, world, rank)))
        row += n
    dev = batch.out_slots.device
    slots = batch.out_slots[own.to(dev)]
    local_slots = slots // (ps * world) * ps + slots % ps
    if per_row:
        return _Plan(own.to(dev), local_slots, reqs, _every_row(batch, table, reqs, rank, world), per_row=True)
    return _Plan(own.to(dev), local_slots, reqs, _decode_rows(batch, table, reqs, rank, world))


def _every_row(batch: ForwardBatch, table: torch.Tensor, reqs: list[_ReqPlan], rank: int,
               world: int) -> _Decode | None:
    """Every new row with keys on this rank as a decode row of its own (`_Decode`, one entry a row):
    the request's pages here, in order, of which it reads the keys at positions up to its own."""
    ps = batch.page_size
    picked, lens, pages = [], [], []
    for i, (seq, r) in enumerate(zip(batch.seq_lens_cpu, reqs, strict=True)):
        mine, _ = own_decode_pages(seq, ps, rank, world)
        if not mine:
            continue
        local = table[i, list(mine)].to(torch.int64) // world
        for pos in range(seq - r.n, seq):
            keys = own_decode_pages(pos + 1, ps, rank, world)[1]
            if keys:
                picked.append(r.row + pos - (seq - r.n))
                lens.append(keys)
                pages.append(local)
    if not picked:
        return None
    rows = torch.tensor(picked, dtype=torch.int64, device=batch.out_slots.device)
    return _Decode(picked, rows, pages, lens)


def _decode_rows(batch: ForwardBatch, table: torch.Tensor, reqs: list[_ReqPlan], rank: int,
                 world: int) -> _Decode | None:
    """The one-token rows' paged decode on this rank (`_Decode`), or None where there is none."""
    ps = batch.page_size
    picked, lens, pages = [], [], []
    for i, (seq, r) in enumerate(zip(batch.seq_lens_cpu, reqs, strict=True)):
        if r.n != 1:
            continue
        mine, keys = own_decode_pages(seq, ps, rank, world)
        if not mine:
            continue
        picked.append(i)
        lens.append(keys)
        pages.append(table[i, list(mine)].to(torch.int64) // world)
    if not picked:
        return None
    rows = torch.tensor([reqs[i].row for i in picked], dtype=torch.int64, device=batch.out_slots.device)
    return _Decode(picked, rows, pages, lens)


class ContextParallelAttention(AttentionBackend):
    """Attention over KV pages spread round robin over the cp group (`parallel_state().cp`, world
    >= 2): stores the K/V of its own pages only, attends its share, merges over the group by LSE
    (one all-gather a layer). The model must call `forward` (q, k, v): a fused prologue that stores
    every row itself would write other ranks' pages into this pool (`owns_kv_writes`)."""

    owns_kv_writes = True

    def __init__(self, group: TPGroup | None = None, workspace: torch.Tensor | None = None) -> None:
        self.cp = group if group is not None else parallel_state().cp
        self._workspace = workspace  # CUDA: the replaced backend's flashinfer workspace, reused (else made on use)
        if self.cp.world < 2:
            raise ValueError("ContextParallelAttention needs a cp group of world >= 2 (use context_parallel())")
        self._plan: _Plan | None = None
        self._fi_decode = None  # CUDA: flashinfer's paged decode wrapper (`_decode_cuda`), made on first use
        self._staging: _Staging | None = None  # CUDA: flashinfer's plan staging (two pinned buffers in turn)
        self._graph: dict[int, object] = {}  # CUDA graphs: the fixed-size decode wrapper of each batch size
        self._graph_bs: int | None = None  # set while a graph's step is captured or planned (`graph_wrapper`)
        # a flash kernel that returns the LSE (O(L) memory) where one exists (`flash_available`);
        # else, and for tests, the exact float32 path
        self.flash = True

    def bind(self, *, num_q_heads: int, kv_pool: KVPool, max_batch: int, max_pages_per_req: int,
             q_dtype: torch.dtype | None = None, fp8_math: bool = False) -> None:
        """CUDA graphs for decode steps where the one-token rows go through flashinfer (`_fi_wrapper`):
        a CUDA pool of K and V in q's half dtype, outside deterministic inference. The graph buffers
        are sized as FlashInferAttention's (a rank's local table is never wider than the global one)."""
        q_dtype = q_dtype or kv_pool.dtype
        eligible = (kv_pool.device.type == "cuda" and kv_pool.layout.is_gqa and kv_pool.dtype == q_dtype
                    and q_dtype in (torch.float16, torch.bfloat16) and not batch_invariant.enabled())
        if eligible and self._fi_decode is None:  # the eager decode's wrapper, made here (None: no flashinfer)
            self._fi_decode = self._fi_wrapper(kv_pool.device)
        self.supports_cuda_graph = eligible and self._fi_decode is not None
        if self.supports_cuda_graph:
            dev = kv_pool.device
            self._geometry = (num_q_heads, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.page_size)
            self._q_dtype = q_dtype
            self._g_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=dev)
            self._g_last = torch.ones(max_batch, dtype=torch.int32, device=dev)
            self._g_indices = torch.zeros(max(1, max_batch * max_pages_per_req), dtype=torch.int32, device=dev)
            # a step's local page ids reach the plan from the device: from the host, flashinfer's copy of
            # them would block until the step in flight is done; indptr and the last page lengths from
            # pinned memory (a pageable source may synchronize too). Pinned staging in turn, as the plan's:
            # [page ids | indptr | last page lengths]
            self._idx_staging = _Staging(4 * (self._g_indices.numel() + 2 * max_batch + 1))
            self._idx_dev = torch.zeros_like(self._g_indices)

    def prepare(self, batch: ForwardBatch) -> None:
        self._graph_bs = None
        self._plan = plan_step(batch, self.cp.rank, self.cp.world, per_row=batch_invariant.enabled())

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        raise RuntimeError("context parallelism attends through forward(q, k, v): the new K/V are needed and "
                           "only their pages' owners store them")

    @property
    def plan(self) -> _Plan:
        """This step's plan (`prepare`): what this rank stores and attends."""
        assert self._plan is not None, "prepare(batch) first"
        return self._plan

    def store_rows(self, layer_id: int, kv_pool: KVPool, *values: torch.Tensor) -> None:
        """Store the rows (of each of the layout's components, [T, heads, dim]: K and V, or MLA's
        one latent) whose page this rank owns, at their local slots."""
        p = self._plan
        if p is not None and p.own_rows.numel():
            kv_pool.store(layer_id, p.own_slots, *(x[p.own_rows] for x in values))

    def partial(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's partial attention of every row: (out [T, Hq, D], lse [T, Hq]) float32."""
        assert self._plan is not None, "prepare(batch) first"
        t, hq, d = q.shape
        o_all = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
        lse_all = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
        flash = self.flash and flash_available(q.device)
        if kv_pool.dtype != q.dtype:  # the self part reads what the pool would give back
            k, v = k.to(kv_pool.dtype).to(q.dtype), v.to(kv_pool.dtype).to(q.dtype)
        if self._plan.per_row:  # every row in `decode`; a row without keys here keeps (0, -inf)
            if not self._decode(q, layer_id, kv_pool, o_all, lse_all) and self._plan.decode is not None:
                raise RuntimeError("deterministic context parallelism needs the CPU attention kernel")
            return o_all, lse_all
        done = self._decode(q, layer_id, kv_pool, o_all, lse_all) if flash else set()
        for i, r in enumerate(self._plan.reqs):
            if i in done:
                continue
            rows = slice(r.row, r.row + r.n)
            if r.prefix_pages is not None and r.prefix_keys > 0:
                kp, vp = kv_pool.gather_pages(layer_id, r.prefix_pages, q.dtype)
                kp, vp = kp[0, : r.prefix_keys], vp[0, : r.prefix_keys]
                o_all[rows], lse_all[rows] = attend_all(q[rows], kp, vp, flash)
            for a, b in r.self_rows:  # causal over the new tokens
                o_s, l_s = causal_tail(q[r.row + a : r.row + b], k[r.row : r.row + b], v[r.row : r.row + b], flash)
                sl = slice(r.row + a, r.row + b)
                o_all[sl], lse_all[sl] = merge_partials(torch.stack([o_all[sl], o_s]), torch.stack([lse_all[sl], l_s]))
        return o_all, lse_all

    def _decode(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool, o_all: torch.Tensor,
                lse_all: torch.Tensor) -> set[int]:
        """The plan's one-token rows in one kernel call (`_Decode`), into o_all / lse_all; returns
        the requests it attended (none where the kernel does not take this cache)."""
        dec = self._plan.decode if self._plan is not None else None
        if dec is None:
            return set()
        if q.device.type == "cuda":
            got = self._decode_cuda(dec, q, layer_id, kv_pool)
        else:
            got = self._decode_cpu(dec, q, layer_id, kv_pool)
        if got is None:
            return set()
        o_all[dec.rows], lse_all[dec.rows] = got
        return set(dec.reqs)

    @staticmethod
    def _decode_cpu(dec: _Decode, q: torch.Tensor, layer_id: int,
                    kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor] | None:
        k_pages, v_pages = kv_pool.k[layer_id], kv_pool.v[layer_id]
        if not cpu_attention.fits(k_pages.dtype, q.shape[-1]):
            return None
        if dec.kernel is None:
            hkv = k_pages.shape[1]
            dec.kernel = cpu_attention.plan(dec.table(), dec.lens, [1] * len(dec.lens), hkv, q.shape[1] // hkv)
        lse = torch.empty(len(dec.reqs), q.shape[1], dtype=torch.float32)
        o = cpu_attention.attend(q[dec.rows], dec.kernel, k_pages, v_pages, kv_pool.page_size, q.shape[-1] ** -0.5,
                                 lse=lse)
        return o, lse

    def _decode_cuda(self, dec: _Decode, q: torch.Tensor, layer_id: int,
                     kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """flashinfer's paged decode over the local table, planned once a step; None where it is
        not installed or the pool's dtype is not q's (the per-request path then attends)."""
        if kv_pool.dtype != q.dtype or q.dtype not in (torch.float16, torch.bfloat16) or batch_invariant.enabled():
            return None
        if self._fi_decode is None:
            self._fi_decode = self._fi_wrapper(q.device)
            if self._fi_decode is None:
                return None
        if not dec.planned:
            self._staging.plan(self._fi_decode, *dec.paged_metadata(kv_pool.page_size), q.shape[1],
                               kv_pool.num_kv_heads, q.shape[-1], kv_pool.page_size, q_data_type=q.dtype,
                               kv_data_type=kv_pool.dtype)
            dec.planned = True
        o, lse = self._fi_decode.run(q[dec.rows], kv_pool.page_view(layer_id), return_lse=True)
        return o.float(), lse * _LN2  # flashinfer's LSE is base 2

    def _fi_wrapper(self, device: torch.device, **graph_buffers: torch.Tensor):  # noqa: ANN202
        """A flashinfer paged-decode wrapper on the workspace (with `graph_buffers`: a CUDA-graph
        one over them), or None where flashinfer is not installed."""
        try:
            import flashinfer
        except ImportError:
            return None
        if self._workspace is None:
            self._workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        if self._staging is None:
            self._staging = _Staging(_INT_WORKSPACE_BYTES)
        graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=graph_buffers["indptr"],
                     paged_kv_indices_buffer=graph_buffers["indices"],
                     paged_kv_last_page_len_buffer=graph_buffers["last"]) if graph_buffers else {}
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True, **graph)

    # ---- CUDA graphs (decode steps; engine/run/cuda_graph.py) ----

    plans_from_lists = True  # the graph runner calls plan_graph_lists with the step's lists

    def uses_table(self, batch_size: int) -> bool:
        return False

    def graph_wrapper(self, bs: int) -> None:
        """The fixed-size decode wrapper of padded batch `bs` (made once), planned with every row on
        the padding page, and the graph path on for the capture that follows."""
        if bs not in self._graph:
            self._graph[bs] = self._fi_wrapper(self._g_indices.device, indptr=self._g_indptr[: bs + 1],
                                               indices=self._g_indices, last=self._g_last[:bs])
        self._plan_graph(bs, np.arange(bs + 1, dtype=np.int32), np.zeros(bs, dtype=np.int32),
                         np.ones(bs, dtype=np.int32))

    def plan_graph_lists(self, bs: int, starts: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """Before a replay: the graph of size `bs` planned over this rank's pages of the step's
        requests (request i: new token at starts[i], global page table tables[i])."""
        ps, rank, world = self._geometry[3], self.cp.rank, self.cp.world
        self._plan_graph(bs, *local_decode_metadata(starts, tables, ps, rank, world, bs))

    def _plan_graph(self, bs: int, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray) -> None:
        hq, hkv, d, ps = self._geometry
        n, cap = len(indices), self._g_indices.numel()
        host = self._idx_staging.take().view(torch.int32)
        a = host.numpy()
        a[:n], a[cap : cap + bs + 1], a[cap + bs + 1 : cap + 2 * bs + 1] = indices, indptr, last
        dev = self._idx_dev[:n]
        dev.copy_(host[:n], non_blocking=True)
        self._staging.plan(self._graph[bs], host[cap : cap + bs + 1], dev, host[cap + bs + 1 : cap + 2 * bs + 1],
                           hq, hkv, d, ps, q_data_type=self._q_dtype, kv_data_type=self._q_dtype)
        self._idx_staging.release()
        self._graph_bs = bs

    def graph_partial(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                      batch: ForwardBatch, kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's partial as the graph captures it (`graph_wrapper` first): every row's K/V
        stored (a row of another rank's page into the padding page), then the planned wrapper over this
        rank's pages: (out [bs, Hq, D], lse [bs, Hq]) float32, as `partial`."""
        if layer_id == 0:  # once a step, from the static positions and global slots (device ops only)
            ps, rank, world = self._geometry[3], self.cp.rank, self.cp.world
            page = batch.positions // ps
            slots = batch.out_slots
            self._g_slots = torch.where(page % world == rank, slots // (ps * world) * ps + slots % ps, PAD_PAGE * ps)
            self._g_empty = (page < rank)[:, None]  # no page of this row on this rank
        kv_pool.store(layer_id, self._g_slots, k, v)
        o, lse = self._graph[self._graph_bs].run(q, kv_pool.page_view(layer_id), return_lse=True)
        return o.float(), torch.where(self._g_empty, float("-inf"), lse * _LN2)

    def merge(self, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's (out | lse) over the cp group, merge in rank order: [T, Hq, D]."""
        parts = _all_gather(self.cp, torch.cat([o, lse[..., None]], -1))
        out, _ = merge_partials(parts[..., :-1], parts[..., -1])
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
                kv_pool: KVPool) -> torch.Tensor:
        if self._graph_bs is not None:
            return self.merge(*self.graph_partial(q, k, v, layer_id, batch, kv_pool)).to(q.dtype)
        self.store_rows(layer_id, kv_pool, k, v)
        return self.merge(*self.partial(q, k, v, layer_id, kv_pool)).to(q.dtype)


def _all_gather(group: TPGroup, x: torch.Tensor) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, in rank order (the same tensor on every rank)."""
    x = x.contiguous()
    if group.symm is not None and group.symm.takes(x):  # CPU ranks of one host: shared memory
        return group.symm.all_gather(x)
    if dist.get_backend(group.group) == "nccl":  # one buffer, one kernel
        out = torch.empty(group.world, *x.shape, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=group.group)
        return out
    parts = [torch.empty_like(x) for _ in range(group.world)]  # gloo has no all_gather_into_tensor
    dist.all_gather(parts, x, group=group.group)
    return torch.stack(parts)


def context_parallel(backend: AttentionBackend) -> AttentionBackend:
    """The attention backend for this rank: `backend` itself at cp world 1 (every existing path
    unchanged, no overhead), else a ContextParallelAttention over `parallel_state().cp`."""
    if parallel_state().cp.world == 1:
        return backend
    return ContextParallelAttention(workspace=getattr(backend, "workspace", None))
