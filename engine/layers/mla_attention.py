"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent KV cache, in torch.

The pool (engine/layers/kv_pool.py, layout `KVLayout.latent`) holds one latent per token and
layer: c = kv_a_layernorm(compressed KV) [kv_lora_rank] then the roped shared key k_pe [rope].
Per head h the expanded key is [W_UK_h c | k_pe] (qk_nope + rope dims) and the value W_UV_h c
(v dims), with W_UK, W_UV the two halves of kv_b_proj's rows. Two forms of one attention:

* non-absorbed (`_expanded`, prefill and prefill chunks): the request's latents are expanded
  through kv_b_proj to K [L, H, qk_nope + rope] and V [L, H, v], then causal attention;
* absorbed (`_absorbed`, decode): q_nope is absorbed into the latent space, q_lat = q_nope W_UK
  [H, kv_lora_rank], and every head attends the cached [c | k_pe] directly (MQA over one
  576-wide "head" for V3); the output o_lat [H, kv_lora_rank] goes through W_UV.

Both give softmax(q_nope . W_UK c + q_pe . k_pe) weighted sums of W_UV c: the same values up
to rounding. The query/key width (qk_nope + rope, or kv_lora_rank + rope) differs from the
value width (v, or kv_lora_rank): the attention here takes them separately.

On CUDA (triton present) the decode rows' attention over the latents is one triton kernel
(engine/layers/mla_kernels.py: paged, split-KV, fp32 accumulation, bf16 or fp8 pool) reading
the batch's page table and lengths on the device: no gather of the latents, no per-request work
on the host. The torch path (`_absorbed` over gathered pages) stays the CPU path and the reference.
Ranks with many heads (the GPU's tuning: KernelTuning.mla_flashinfer_min_heads, 64 on an H200)
take flashinfer's MLA wrapper instead (engine/layers/flashinfer_mla.py), planned by MLABackend:
per eager step in `prepare`, per replay through the graph runner's planned protocol
(`graph_wrapper`, `plan_graph_arrays`); 3.0-3.6x faster than ours at 128 heads on an H200.
Where the pool has 64-token pages (an MLA model's default on CUDA) and the tuning says so
(KernelTuning.mla_flashmla), every rank takes FlashMLA (engine/layers/flash_mla.py) instead: the
same table and lengths as ours, its split schedule made once a step by MLAPlan.build.

With deterministic inference (engine/layers/batch_invariant.py) every row takes the absorbed
form and the absorption GEMMs run in fixed row blocks, so a token's bits do not depend on the
batch, its prefill chunks or its cached prefix. On CUDA every new token, prefill and decode alike,
is a row of the triton kernel over its causal prefix (`MLAPlan.every_row`; a row's split lengths
are a function of its own length only), so the decode and verify steps run in CUDA graphs. On
the CPU by cpu_attention's kernel over the pages in place (`_invariant`; the torch path,
batch_invariant.softmax_chunks, where that kernel does not build or take the KV dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from engine.layers import batch_invariant, cpu_attention, triton_ops
from engine.layers.attention import AttentionBackend
from engine.layers.flash_mla import FlashMLA, flashmla_supported
from engine.layers.flashinfer_mla import FlashInferMLA, flashinfer_mla_supported
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import PAD_PAGE, KVPool
from engine.layers.lse_attention import flash_available, merge_partials, sdpa_lse
from engine.layers.tuning import kernel_tuning

log = structlog.get_logger()

# a prefill chunk after a cached prefix longer than this many tokens expands the prefix's latents
# this many keys at a time (`_expanded_chunked`): at 128 heads a 32k prefix expanded whole took
# 2.7 GB of K and V per layer; a chunk of 4096 takes 0.4 GB
PREFIX_CHUNK = 4096


@dataclass(frozen=True)
class MLAShapes:
    """One rank's MLA geometry: `heads` query heads, the latent's kv_lora_rank and rope dims."""

    heads: int
    kv_lora_rank: int
    qk_nope: int
    rope: int
    v: int
    scale: float  # softmax scale: qk_head_dim^-0.5, times YaRN's mscale^2 where the config says so


@dataclass
class _Req:
    row_start: int
    rows: int  # new tokens
    seq_len: int  # KV length after this step
    pages: torch.Tensor  # int64 [n]: the pages covering positions 0..seq_len-1
    # bool [rows, seq_len]: with a cached prefix the diagonal shifted right by it; None for a cached
    # prefix longer than PREFIX_CHUNK (attended chunk by chunk, `_expanded_chunked`)
    causal: torch.Tensor | None


@dataclass
class MLAPlan:
    """One step's attention plan, shared by every layer: decode requests (one new token) take
    the absorbed form in one padded batch, the others the expanded form one request at a time;
    with deterministic inference one batch_invariant plan for every row."""

    decode_rows: torch.Tensor | None  # int64 [b]
    decode_pages: torch.Tensor | None  # int64 [b, n]
    decode_mask: torch.Tensor | None  # bool [b, 1, n * page_size]: position < seq_len
    extends: list[_Req]
    invariant: batch_invariant.Plan | cpu_attention.Plan | None = None
    all_decode: bool = False
    absorb_extends: bool = False  # prefill rows in the absorbed form too (one row at a time)
    # the decode kernel's inputs (CUDA): int32 page table [b, W] and KV lengths [b] on the device
    decode_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_table_rows: torch.Tensor | None = None  # int32 [b]: a row's table row (every_row's prefill)
    decode_fi: FlashInferMLA | None = None  # or flashinfer's MLA wrapper, planned for the decode rows
    decode_fm: FlashMLA | None = None  # or FlashMLA over decode_table / decode_lens, with its schedule:
    decode_sched: object = None  # made once a step from decode_lens (FlashMLA.schedule)

    @classmethod
    def build(cls, batch: ForwardBatch, absorb_all: bool = False, kernel: bool | None = None,
              graph: tuple[torch.Tensor, torch.Tensor] | FlashInferMLA | None = None,
              trees: dict[int, torch.Tensor] | None = None, flashmla: FlashMLA | None = None,
              kv: KVPool | None = None) -> MLAPlan:
        """`absorb_all`: every row in the absorbed form (tests compare it with the expanded one).
        `trees`: speculative draft trees (AttentionBackend.step_trees): request i's new tokens see
        its whole cached prefix and, among themselves, what trees[i] (bool [n, n]) allows.
        `kernel`: decode rows through a kernel (None: on CUDA where triton is).
        `graph` (MLABackend.graph): a CUDA graph's static (page table, lengths), read instead of the
        batch's in a pure decode step; or flashinfer's MLA wrapper planned for this step's decode
        rows (a graph's or an eager step's), which then run on it. `flashmla`: the kernel's decode
        rows (table and lengths) go to FlashMLA (MLABackend.fm), its schedule made here once a step.
        `kv`: the latent pool, whose dtype decides whether deterministic inference on a CPU takes
        cpu_attention's kernel (else the torch path)."""
        lens, seqs, ps = batch.extend_lens_cpu, batch.seq_lens_cpu, batch.page_size
        dev = batch.page_table.device
        if kernel is None:
            kernel = decode_kernel_available(dev)
        if batch_invariant.enabled():
            if kernel:
                return cls.every_row(batch, graph if isinstance(graph, tuple) else None)
            if dev.type == "cpu" and kv is not None and cpu_attention.fits(kv.dtype, kv.head_dim):
                # one token a block: its rows are the query heads (many, in the models that use MLA)
                inv = cpu_attention.plan(batch.page_table, seqs, lens, 1, tokens=1)
                return cls(None, None, None, [], invariant=inv)
            inv = batch_invariant.plan(batch.page_table, seqs, lens, ps, kernel=False)
            return cls(None, None, None, [], invariant=inv)
        fi = graph if isinstance(graph, FlashInferMLA) else None
        if kernel and batch.is_decode and not absorb_all:
            # a pure decode step: device tensors only, no host work per request (capturable)
            if fi is not None:
                fi.check_rows(batch.batch_size)
                return cls(None, None, None, [], all_decode=True, decode_fi=fi)
            table, seq = graph if graph is not None else (batch.page_table, batch.seq_lens)
            return cls(None, None, None, [], all_decode=True, decode_table=table, decode_lens=seq)._on(flashmla)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dec = [i for i, n in enumerate(lens) if n == 1]
        plan = cls(None, None, None, [], all_decode=len(dec) == len(lens))
        if dec:
            plan._plan_decode(batch, dec, starts, kernel, fi)
            if kernel and fi is None:
                plan._on(flashmla)
        for i, n in enumerate(lens):
            if n > 1:
                pages = batch.page_table[i, : -(-seqs[i] // ps)].to(torch.int64)
                causal = None
                tree = trees.get(i) if trees else None
                if tree is not None:  # the prefix, then the tree's own mask (row order = KV order)
                    causal = torch.cat([torch.ones(n, seqs[i] - n, dtype=torch.bool, device=dev), tree.to(dev)], 1)
                elif seqs[i] - n <= PREFIX_CHUNK or absorb_all or not flash_available(dev):
                    keys, queries = torch.arange(seqs[i], device=dev), torch.arange(seqs[i] - n, seqs[i], device=dev)
                    causal = keys[None, :] <= queries[:, None]
                plan.extends.append(_Req(starts[i], n, seqs[i], pages, causal))
        plan.absorb_extends = absorb_all
        return plan

    @classmethod
    def every_row(cls, batch: ForwardBatch, graph: tuple[torch.Tensor, torch.Tensor] | None) -> MLAPlan:
        """Deterministic inference through the kernel: each new token a row over its causal prefix,
        reading its request's table row (a pure decode step: the batch's or a graph's table and
        lengths as they are)."""
        if batch.is_decode:
            table, seq = graph if graph is not None else (batch.page_table, batch.seq_lens)
            return cls(None, None, None, [], all_decode=True, decode_table=table, decode_lens=seq)
        lens, seqs, dev = batch.extend_lens_cpu, batch.seq_lens_cpu, batch.page_table.device
        rows = [i for i, n in enumerate(lens) for _ in range(n)]
        upto = [k for n, s in zip(lens, seqs, strict=True) for k in range(s - n + 1, s + 1)]
        return cls(None, None, None, [], all_decode=True, decode_table=batch.page_table,
                   decode_lens=torch.tensor(upto, dtype=torch.int32, device=dev),
                   decode_table_rows=torch.tensor(rows, dtype=torch.int32, device=dev))

    def _on(self, fm: FlashMLA | None) -> MLAPlan:
        """The kernel's decode rows (decode_table, decode_lens) to FlashMLA where given."""
        if fm is not None:
            self.decode_fm, self.decode_sched = fm, fm.schedule(self.decode_lens)
        return self

    def _plan_decode(self, batch: ForwardBatch, dec: list[int], starts: list[int], kernel: bool,
                     fi: FlashInferMLA | None) -> None:
        """The decode rows `dec` of a step that also has longer rows: flashinfer's planned wrapper,
        the kernel's table and lengths, or (torch path) their pages and a length mask."""
        dev = batch.page_table.device
        req = torch.tensor(dec, dtype=torch.int64, device=dev)
        self.decode_rows = torch.tensor([starts[i] for i in dec], dtype=torch.int64, device=dev)
        if kernel and fi is not None:
            fi.check_rows(len(dec))
            self.decode_fi = fi
            return
        if kernel:
            self.decode_table, self.decode_lens = batch.page_table[req], batch.seq_lens[req]
            return
        n = -(-max(batch.seq_lens_cpu[i] for i in dec) // batch.page_size)
        self.decode_pages = batch.page_table[req][:, :n].to(torch.int64)
        pos = torch.arange(n * batch.page_size, device=dev)
        self.decode_mask = (pos[None, :] < batch.seq_lens[req].to(torch.int64)[:, None])[:, None, :]


def mla_attend(
    q_nope: torch.Tensor, q_pe: torch.Tensor, plan: MLAPlan, kv: KVPool, layer: int, w_kv_b: torch.Tensor,
    s: MLAShapes,
) -> torch.Tensor:
    """Attention output [T, H, v] (q's dtype) of q_nope [T, H, qk_nope] and roped q_pe [T, H, rope]
    over `layer`'s latents (this step's already stored), w_kv_b = kv_b_proj's weight [H * (qk_nope
    + v), kv_lora_rank] (this rank's heads)."""
    w = w_kv_b.view(s.heads, s.qk_nope + s.v, s.kv_lora_rank)
    w_uk, w_uv = w[:, : s.qk_nope], w[:, s.qk_nope :]
    t = q_nope.shape[0]
    if plan.invariant is not None:
        return _invariant(q_nope, q_pe, plan.invariant, kv, layer, w_uk, w_uv, s)
    kernel = plan.decode_table is not None or plan.decode_fi is not None
    if plan.all_decode and kernel:
        return _absorbed_kernel(q_nope, q_pe, plan, kv, layer, w_uk, w_uv, s)
    out = q_nope.new_empty(t, s.heads, s.v)
    if plan.decode_rows is not None:
        rows = None if plan.all_decode else plan.decode_rows
        qn = q_nope if rows is None else q_nope[rows]
        qp = q_pe if rows is None else q_pe[rows]
        if kernel:
            o = _absorbed_kernel(qn, qp, plan, kv, layer, w_uk, w_uv, s)
        else:
            (lat,) = kv.gather_pages(layer, plan.decode_pages, q_nope.dtype)  # [b, Lk, 1, latent]
            o = _absorbed(qn, qp, lat[:, :, 0], plan.decode_mask, w_uk, w_uv, s)
        if rows is None:
            return o
        out[rows] = o
    for r in plan.extends:
        (lat,) = kv.gather_pages(layer, r.pages[None], q_nope.dtype)
        lat = lat[0, : r.seq_len, 0]  # [Lk, latent]
        sl = slice(r.row_start, r.row_start + r.rows)
        if plan.absorb_extends:
            qn, qp = q_nope[sl], q_pe[sl]
            out[sl] = torch.cat([
                _absorbed(qn[i : i + 1], qp[i : i + 1], lat[None], r.causal[i][None, None], w_uk, w_uv, s)
                for i in range(r.rows)
            ])
        elif r.causal is None:  # a long cached prefix: expanded a chunk at a time
            out[sl] = _expanded_chunked(q_nope[sl], q_pe[sl], lat, r.seq_len - r.rows, w_uk, w_uv, s)
        else:  # no cached prefix: plain causal (SDPA's own mask)
            out[sl] = _expanded(q_nope[sl], q_pe[sl], lat, r.causal if r.seq_len > r.rows else None, w_uk, w_uv, s)
    return out


def expand_latents(lat: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes,
            v_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents lat [Lk, latent] -> per-head K [H, Lk, qk_nope + rope] and V [H, Lk, v] (zero-padded
    to `v_width` columns where given)."""
    c, k_pe = lat[:, : s.kv_lora_rank], lat[:, s.kv_lora_rank :]
    lk = lat.shape[0]
    k = lat.new_empty(s.heads, lk, s.qk_nope + s.rope)
    k[..., : s.qk_nope].copy_(torch.einsum("lr,hnr->hln", c, w_uk))
    k[..., s.qk_nope :].copy_(k_pe[None].expand(s.heads, lk, s.rope))  # the rope key is shared by the heads
    v = torch.einsum("lr,hvr->hlv", c, w_uv)  # [H, Lk, v]
    if v_width is not None and v_width > s.v:
        v = F.pad(v, (0, v_width - s.v))
    return k, v


def _heads_first(q_nope: torch.Tensor, q_pe: torch.Tensor, s: MLAShapes) -> torch.Tensor:
    """q_nope [Lq, H, qk_nope] and q_pe [Lq, H, rope] -> q [H, Lq, qk_nope + rope]."""
    q = q_nope.new_empty(s.heads, q_nope.shape[0], s.qk_nope + s.rope)
    q[..., : s.qk_nope].copy_(q_nope.transpose(0, 1))
    q[..., s.qk_nope :].copy_(q_pe.transpose(0, 1))
    return q


def _expanded_chunked(q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, start: int,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes, chunk: int | None = None) -> torch.Tensor:
    """`_expanded` for new tokens at positions start.. after a long cached prefix, with memory
    bounded by PREFIX_CHUNK: the prefix's latents are expanded PREFIX_CHUNK keys at a time, each
    chunk attended unmasked (every cached key precedes every new token), the new tokens' own keys
    causally, each part by a flash kernel that returns its log-sum-exp, and the parts merged by
    it (lse_attention.merge_partials: exactly the attention over all keys). V is zero-padded to
    K's width for the kernels that want equal widths."""
    q = _heads_first(q_nope, q_pe, s)[None]
    width, chunk = s.qk_nope + s.rope, chunk or PREFIX_CHUNK
    outs, lses = [], []
    for a in [*range(0, start, chunk), start]:
        b, causal = (min(a + chunk, start), False) if a < start else (lat.shape[0], True)
        k, v = expand_latents(lat[a:b], w_uk, w_uv, s, width)
        o, lse = sdpa_lse(q, k[None], v[None], causal=causal, scale=s.scale)
        outs.append(o[0, :, :, : s.v])
        lses.append(lse[0])
    o, _ = merge_partials(torch.stack(outs), torch.stack(lses))  # [H, Lq, v] float32
    return o.transpose(0, 1).to(q_nope.dtype)


def _expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, causal: torch.Tensor | None,
              w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes) -> torch.Tensor:
    """Non-absorbed: the latents lat [Lk, latent] expanded to per-head K [qk_nope + rope] and V [v],
    then SDPA (its flash kernels take a v width other than the qk one; no [H, Lq, Lk] scores kept).
    q [Lq, H, *], causal bool [Lq, Lk] (None: plain causal, no cached prefix) -> [Lq, H, v]."""
    k, v = expand_latents(lat, w_uk, w_uv, s)
    q = _heads_first(q_nope, q_pe, s)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal, is_causal=causal is None,
                                       scale=s.scale)
    return o[0].transpose(0, 1)


def _absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, mask: torch.Tensor,
              w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes) -> torch.Tensor:
    """Absorbed (MQA over the latent): q [b, H, *], lat [b, Lk, latent], mask bool [b, 1, Lk]
    -> [b, H, v]."""
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # q_nope absorbed by W_UK
    q = torch.cat([q_lat, q_pe], dim=-1)  # [b, H, latent]
    scores = torch.bmm(q, lat.transpose(1, 2))  # [b, H, Lk]
    probs = (scores.float() * s.scale).masked_fill(~mask, float("-inf")).softmax(-1).to(lat.dtype)
    o_lat = torch.bmm(probs, lat[:, :, : s.kv_lora_rank])  # [b, H, kv_lora_rank]
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)  # through W_UV


class MLABackend(AttentionBackend):
    """The attention backend an MLA model gets on CUDA (engine/run/assembly.py). The model attends
    its latent pool itself (`mla_attend`); this backend holds what the step's decode rows read
    instead of the batch's tensors (`graph`, which the model hands MLAPlan.build). With our triton
    kernel: a captured graph's static page table and lengths, filled before each replay through
    engine/run/cuda_graph.py's dense-table protocol (`uses_table`, `set_graph_table`). With
    flashinfer's MLA wrapper (`kernel` "flashinfer", the GPU's tuning): the wrapper, planned for
    an eager step's decode rows in `prepare` and before each replay through the runner's planned
    protocol (`uses_table` False, `graph_wrapper`, `plan_graph_arrays`: padded indptr and last page
    lengths on the host, page indices on the device). With FlashMLA (`kernel` "flashmla", `fm`): the
    dense-table protocol, as ours."""

    supports_cuda_graph = True
    takes_tree_masks = True  # a tree row is a prefill-shaped row: the expanded torch path masks it

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # set for capture/replay (and flashinfer's eager steps), cleared by prepare
        self.graph: tuple[torch.Tensor, torch.Tensor] | FlashInferMLA | None = None
        self.kernel = "triton"
        self.fi: FlashInferMLA | None = None
        self.fm: FlashMLA | None = None

    def bind(
        self, *, num_q_heads: int, kv_pool: KVPool, max_batch: int, max_pages_per_req: int,
        q_dtype: torch.dtype | None = None, fp8_math: bool = False,
    ) -> None:
        self._g_seq = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self._g_table = torch.full((max_batch, max_pages_per_req), PAD_PAGE, dtype=torch.int32, device=self.device)
        # the graph runner sizes its staging buffers by this (a dense table of every row): its size only
        self._g_indices = torch.empty(max_batch * max_pages_per_req, dtype=torch.int32, device="meta")
        q_dtype = q_dtype or kv_pool.dtype
        # deterministic inference keeps our kernel: its rows are batch-invariant, the others' split
        # schedules depend on the batch
        free = not batch_invariant.enabled()
        ok = free and flashinfer_mla_supported(self.device, q_dtype, kv_pool.dtype, kv_pool.head_dim)
        fm_ok = free and flashmla_supported(self.device, q_dtype, kv_pool.dtype, kv_pool.head_dim, kv_pool.page_size)
        self.kernel = kernel_tuning(self.device).mla_decode_kernel(num_q_heads, ok, fm_ok)
        if self.kernel == "flashinfer":
            self.fi = FlashInferMLA(self.device, num_q_heads, kv_pool, q_dtype, max_batch, max_pages_per_req)
        elif self.kernel == "flashmla":
            self.fm = FlashMLA(num_q_heads)
        if self.device.type == "cuda":
            log.info("mla decode kernel", kernel=self.kernel, heads=num_q_heads, flashinfer_supported=ok,
                     flashmla_supported=fm_ok, page_size=kv_pool.page_size)

    def prepare(self, batch: ForwardBatch) -> None:
        """An eager step: the model reads the batch's page table (triton), or flashinfer's wrapper
        planned here for the step's decode rows (one new token each)."""
        self.graph = None
        self.take_trees()  # MLAPlan reads step_trees into the tree rows' expanded attention
        if self.fi is None or batch_invariant.enabled():
            return
        dec = [i for i, n in enumerate(batch.extend_lens_cpu) if n == 1]
        if not dec:
            return
        table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table.cpu()
        if len(dec) < batch.batch_size:
            table = table[dec]
        self.graph = self.fi.eager([batch.seq_lens_cpu[i] for i in dec], table)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        raise NotImplementedError("an MLA model attends its latent pool in mla_attention.mla_attend")

    def uses_table(self, batch_size: int) -> bool:
        """Whether a replay is fed the dense table (our kernel) rather than planned (flashinfer)."""
        return self.fi is None

    def graph_wrapper(self, bs: int) -> None:
        """Before capturing size `bs`: every row padding (one token on the padding page)."""
        if self.fi is not None:
            self.graph = self.fi.graph_wrapper(bs)
            return
        empty = torch.empty(0, 1, dtype=torch.int32, device=self.device)
        self.set_graph_table(bs, empty[:, 0], empty)

    def plan_graph_arrays(self, bs: int, indptr: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
        """Before replaying size `bs` (flashinfer): indptr [bs + 1] and last page lengths [bs] on
        the host (pinned int32), page indices [nnz] on the device; rows past the step's are padding
        (one token on the padding page)."""
        assert self.fi is not None, "plan_graph_arrays without flashinfer's MLA wrapper"
        self.graph = self.fi.plan_graph(bs, indptr, last, indices)

    def set_graph_table(self, bs: int, seq_lens: torch.Tensor, table: torch.Tensor) -> None:
        """This step's seq_lens int32 [b] and page table int32 [b, w] (device) into the static
        buffers the graph of size `bs` reads; rows b..bs become padding."""
        b, w = table.shape
        self._g_seq[:b].copy_(seq_lens)
        self._g_table[:b, :w].copy_(table)
        if b < bs:
            self._g_seq[b:bs].fill_(1)
            self._g_table[b:bs, 0].fill_(PAD_PAGE)
        self.graph = (self._g_table[:bs], self._g_seq[:bs])


def decode_kernel_available(device: torch.device) -> bool:
    """Whether decode rows on `device` take a kernel (CUDA with triton): ours, or flashinfer's where
    MLABackend chose it."""
    return device.type == "cuda" and triton_ops.available()


def _absorbed_kernel(q_nope: torch.Tensor, q_pe: torch.Tensor, plan: MLAPlan, kv: KVPool, layer: int,
                     w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes) -> torch.Tensor:
    """The absorbed form with the attention in engine/layers/mla_kernels.py (through
    plan.decode_table) or flashinfer's planned wrapper (plan.decode_fi): q [b, H, *] -> [b, H, v];
    the latents are read in place."""
    det = batch_invariant.enabled()  # the absorptions in fixed row blocks
    q_lat = _absorb_rows(q_nope, w_uk, "bhn,hnr->bhr") if det else torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    if plan.decode_fi is not None:
        o_lat = plan.decode_fi.run(q_lat, q_pe, kv, layer, s)
    elif plan.decode_fm is not None:
        o_lat = plan.decode_fm.run(q_lat, q_pe, kv.latent[layer], plan.decode_table, plan.decode_lens,
                                   plan.decode_sched, s.scale)
    else:
        from engine.layers import mla_kernels  # triton: imported on first use, on CUDA

        o_lat = mla_kernels.mla_decode(q_lat, q_pe, kv.latent[layer], plan.decode_table, plan.decode_lens,
                                       s.scale, kv.page_size, table_rows=plan.decode_table_rows)
    return _absorb_rows(o_lat, w_uv, "bhr,hvr->bhv") if det else torch.einsum("bhr,hvr->bhv", o_lat, w_uv)


def _absorb_rows(x: torch.Tensor, w: torch.Tensor, eq: str) -> torch.Tensor:
    """einsum(eq, x, w) for x [T, H, *] in fixed blocks of batch_invariant.ROWS rows (a row's bits
    do not depend on T)."""
    return batch_invariant.in_blocks(lambda xb: torch.einsum(eq, xb, w), batch_invariant.ROWS, x)


def _invariant(q_nope: torch.Tensor, q_pe: torch.Tensor, p: batch_invariant.Plan | cpu_attention.Plan, kv: KVPool,
               layer: int, w_uk: torch.Tensor, w_uv: torch.Tensor, s: MLAShapes) -> torch.Tensor:
    """Deterministic inference: the absorbed form for every row, with one latent 'KV head' and
    value = its first kv_lora_rank: on a CPU by cpu_attention's kernel, else in batch_invariant's
    blocks of query tokens x KV chunks from position 0 (batch_invariant.softmax_chunks)."""
    t, h = q_nope.shape[:2]
    r = s.kv_lora_rank
    q_lat = _absorb_rows(q_nope.float(), w_uk.float(), "thn,hnr->thr")
    if isinstance(p, cpu_attention.Plan):
        lat = kv.latent[layer]
        o_lat = cpu_attention.attend(torch.cat([q_lat, q_pe.float()], dim=-1), p, lat, lat, kv.page_size, s.scale,
                                     dv=r)
        return _absorb_rows(o_lat, w_uv.float(), "thr,hvr->thv").to(q_nope.dtype)
    out = q_nope.new_empty(t, h, s.v)
    nb, tok = p.rows.shape[0], p.tokens
    if nb == 0:
        return out
    q = torch.cat([q_lat, q_pe.float()], dim=-1) * s.scale  # [T, H, latent]
    qb = q[p.rows].reshape(1, nb, tok * h, -1)  # [1, nb, tokens * H, latent]
    o_lat = q.new_empty(1, nb, tok * h, r)
    for g in p.groups:
        (lat,) = kv.gather_heads(layer, g.pages)  # [1, blocks, keys, latent]
        o_lat[:, g.start : g.end] = batch_invariant.softmax_chunks(qb[:, g.start : g.end], lat, lat[..., :r],
                                                                   g.hidden, g.chunks)
    o = _absorb_rows(o_lat.view(nb * tok, h, r)[p.real], w_uv.float(), "thr,hvr->thv")
    out[p.rows.view(-1)[p.real]] = o.to(out.dtype)
    return out
