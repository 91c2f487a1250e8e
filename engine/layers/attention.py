"""Attention backends: one interface over paged KV, chosen by name.

`torch` is the reference (CPU and GPU, scaled_dot_product_attention over KV gathered
through the page table). `flashinfer` (GPU, paged kernels) plugs in through a lazy
import so CPU installs never need it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from engine.layers import batch_invariant, cpu_attention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import PAD_PAGE, KVPool

log = structlog.get_logger()


class AttentionBackend(ABC):
    """Causal attention of each request's new tokens over its whole paged KV.

    Contract:
    - `bind(...)` is called once by the runner after the KV pool exists (head counts,
      pool, the largest batch); backends that plan kernels size their buffers there.
    - `prepare(batch)` is called once per step, before the model's forward, and may
      precompute per-step state (index tensors, kernel plans) shared by all layers.
    - `attend(q, layer_id, batch, kv_pool)` with q [T, Hq, D] (T = batch.num_tokens, Hq a
      multiple of Hkv), called after this step's K/V of layer `layer_id` are in the pool at
      batch.out_slots, returns out [T, Hq, D] (q's dtype): for each new token at position p
      of request i, softmax(q K^T / sqrt(D)) V over that request's KV positions 0..p
      (cached prefix plus this step's tokens), read through batch.page_table[i].
    - `forward(q, k, v, ...)` (k, v [T, Hkv, D]) stores k, v first, then attends. Models
      whose prologue writes K/V itself (engine/layers/triton_ops.py) call `attend` directly.
    - Head dims: q and K share the qk head dim, V and the output the v head dim; these backends
      take K/V pools (`KVLayout.gqa`: one head dim for both). MLA, whose qk and v dims differ
      (192 / 128 expanded, 576 / 512 absorbed for DeepSeek-V3), attends its latent pool in
      engine/layers/mla_attention.py; the runner then binds the torch backend, unused.
    """

    # whether engine/run/cuda_graph.py can capture this backend's decode (see FlashInferAttention)
    supports_cuda_graph: bool = False
    # the backend decides which rows' K/V it stores (context parallelism: only its own pages'), so
    # the model must hand it q, k, v through `forward`, never store K/V itself (the fused prologue)
    owns_kv_writes: bool = False
    # speculative draft trees (docs/architecture.md, Trees): whether `set_tree_masks` is taken, and
    # this step's masks after `prepare` (`take_trees`), read by models that attend their own pool (MLA)
    takes_tree_masks: bool = False
    step_trees: dict[int, torch.Tensor] = {}  # noqa: RUF012 (replaced per step, never mutated)
    _next_trees: dict[int, torch.Tensor] = {}  # noqa: RUF012 (set_tree_masks' masks for the next prepare)

    def set_tree_masks(self, masks: dict[int, torch.Tensor]) -> None:
        """The next `prepare`'s draft trees: request i's new tokens see its cached prefix and,
        among themselves, what masks[i] (bool [n, n]) allows. Only where `takes_tree_masks`."""
        if not self.takes_tree_masks:
            raise NotImplementedError(f"{type(self).__name__} takes no draft-tree masks")
        self._next_trees = masks

    def take_trees(self) -> dict[int, torch.Tensor]:
        """In `prepare`: this step's trees (from set_tree_masks, else none), now `step_trees`;
        the next step has none unless set again."""
        self.step_trees, self._next_trees = self._next_trees, {}
        return self.step_trees

    def bind(
        self, *, num_q_heads: int, kv_pool: KVPool, max_batch: int, max_pages_per_req: int,
        q_dtype: torch.dtype | None = None, fp8_math: bool = False,
    ) -> None:
        """Learn the model's attention geometry once (default: nothing to do). q_dtype is the
        activations' dtype when the KV pool stores another (an 8-bit KV cache); fp8_math lets
        a backend attend an 8-bit KV cache in 8-bit math (--attention-fp8-math)."""
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor: ...

    def attend_qkv(
        self, qkv: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor | None:
        """Optional: attention straight from the layer's QKV projection [T, (Hq + 2 Hkv) * D], with
        the prologue (optional q/k RMSNorm, neox RoPE at `positions` from `cos_sin_cache`, the K/V
        store) in the backend's own kernel. Returns out [T, Hq, D], or None when this step's kernel
        does not take QKV (the default): the model then runs the prologue and calls `attend`."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        kv_pool.store(layer_id, batch.out_slots, k, v)
        return self.attend(q, layer_id, batch, kv_pool)


@dataclass
class _DecodeGroup:
    """Requests with one new token each, attended in one padded SDPA call."""

    rows: torch.Tensor  # int64 [b]: their rows in T
    pages: torch.Tensor  # int64 [b, n]: pages of positions 0..n*page_size-1 (padding: page 0)
    mask: torch.Tensor  # bool [b, 1, 1, n*page_size]: position < seq_len
    bias: torch.Tensor | None = None  # the mask as 0 / -inf in the activations' dtype (CPU half: made once a step)


@dataclass
class _ExtendReq:
    """One request with several new tokens (a prefill or a prefill chunk), or on CPU `count`
    fresh prefills (start 0) of equal length in consecutive rows, attended in one SDPA call."""

    row_start: int
    row_end: int
    pages: torch.Tensor  # int64 [count, n]: the pages covering positions 0..seq_len-1
    seq_len: int
    start: int  # cached prefix length: the new tokens are at positions start..seq_len-1
    mask: torch.Tensor | None  # bool [Lq, Lk] for the masked path; None when it is not used
    count: int = 1


# CPU flash attention that also returns the log-sum-exp, so a chunk can attend its cached
# prefix (unmasked) and itself (causal) separately and merge the two exactly; None when this
# torch lacks it (the masked SDPA path is then used).
_CPU_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sdpa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:  # noqa: ANN003
    """SDPA on [H, L, D] tensors, called with a batch dim of 1: on CPU only 4-D inputs reach the
    flash kernel; 3-D ones take the math path, which materializes [H, Lq, Lk] scores (3-10x
    slower, most of an 8k-token prefill's time)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kw)[0]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query token per request, in float32: q [b, Hq, D], k/v [b, Lk, Hkv, D], mask [b, 1, 1, Lk]
    -> [b, Hq, D]. Two batched GEMMs over (request, KV head), for half-precision KV: CPU flash
    SDPA with a mask took 1.35 ms a layer in bf16 (40 ms of a 16-request decode step); in fp32
    SDPA stays (it measured faster inside the model)."""
    b, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv  # a GQA group's query heads share one KV head
    kt = k.permute(0, 2, 1, 3).reshape(b * hkv, lk, d)
    vt = v.permute(0, 2, 1, 3).reshape(b * hkv, lk, d)
    scores = torch.bmm(q.float().view(b * hkv, g, d), kt.transpose(1, 2)) * d**-0.5
    probs = scores.view(b, hkv, g, lk).masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.bmm(probs.view(b * hkv, g, lk), vt).view(b, hq, d)


def _decode_sdpa_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query token per request on CPU: q [b, Hq, D], k/v [b, Lk, Hkv, D], mask [b, 1, 1, Lk]
    (bool, or additive in q's dtype) -> [b, Hq, D]. A GQA group's query heads become the query
    rows of their KV head ([b, Hkv, group, D]): one flash SDPA call over (request, KV head) with
    the mask broadcast over the rows. In bf16 this measured 0.43 ms a layer at 16 x 160 positions,
    against 2.6 ms for SDPA with enable_gqa and one query row per head, and 1.1 ms for two fp32
    GEMMs after converting and transposing the gathered KV (_decode_attention); in float32 (the
    default model's 9 / 3 heads, 16 requests, 2 cores) 0.25 against 0.43 ms at 192 positions, 1.1
    against 1.7 ms at 1024, with an additive mask (a bool one costs ~10% more)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    o = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask)
    return o.view(b, hq, d)


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of q [Hq, Lq, D] (positions start..start+Lq-1) over k, v [Hkv, start+Lq, D] with
    the causal diagonal shifted right by `start`, on CPU: the prefix part has no mask and the
    chunk part is plain causal, so both run the flash kernel with no mask tensor and no masked
    blocks computed; the two are merged by their log-sum-exp."""
    hq, lq, d = q.shape
    hkv, group = k.shape[0], hq // k.shape[0]
    # prefix: no mask, so a GQA group's query rows can share one KV head: [Hkv, group*Lq, D]
    o1, l1 = _CPU_FLASH_LSE(q.reshape(hkv, group * lq, d)[None], k[None, :, :start], v[None, :, :start])
    o1, l1 = o1.reshape(hq, lq, d), l1.reshape(hq, lq)
    kc, vc = k[:, start:].repeat_interleave(group, 0), v[:, start:].repeat_interleave(group, 0)
    o2, l2 = _CPU_FLASH_LSE(q[None], kc[None], vc[None], is_causal=True)
    lse = torch.logaddexp(l1, l2[0])
    return o1 * torch.exp(l1 - lse)[..., None] + o2[0] * torch.exp(l2[0] - lse)[..., None]


class TorchAttention(AttentionBackend):
    """Reference backend: gathers each request's KV slots and calls SDPA.

    Decode requests share one batched call (padded to the longest KV, masked); each
    extend request gets its own call, so a long prefill never pads the decodes. With
    deterministic inference every row takes batch_invariant's one path; on CUDA, where its
    kernel fits, decode is captured in CUDA graphs (bind, `_graph_attend`).
    """

    takes_tree_masks = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._decode: _DecodeGroup | None = None
        self._extends: list[_ExtendReq] = []
        self._all_decode = False
        # deterministic inference: the one path (two plans in a step of decodes and prefills on the torch path)
        self._invariant: list[batch_invariant.Plan] | None = None
        self._kernel = False  # that path's CUDA kernel takes this model (bind)
        self._cpu_kernel = False  # on a CPU: cpu_attention's kernel takes it (bind)
        self._cpu_plan: cpu_attention.Plan | None = None
        self._block_tokens = batch_invariant.TOKENS  # tokens per block of that path (bind)
        # deterministic decode in CUDA graphs (bind): (page table, KV lengths) of the graph's rows,
        # set for capture / replay and cleared by prepare; the layer that rebuilds the blocks
        self._graph: tuple[torch.Tensor, torch.Tensor] | None = None
        self._g_layer: int | None = None
        self._g_now: tuple[torch.Tensor, ...] = ()
        self._g_heads = (0, 0, 0)  # (q heads, KV heads, head dim) for the split-KV scratch (bind)
        self._g_page, self._g_parts = 1, 1  # the pool's page size; a row's most KV partitions
        self._g_splits = 1  # split-KV programs per row and KV head of the graph being captured
        self._g_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_tree_masks(self, masks: dict[int, torch.Tensor]) -> None:
        """Speculative decoding's draft trees, for the next `prepare` only: request i's new
        tokens attend every cached token and, among themselves, what masks[i] allows (bool
        [n, n]: row q may see new token k; its ancestors and itself), not causally."""
        if masks and batch_invariant.enabled():
            raise ValueError("draft trees need the torch attention backend without deterministic inference")
        super().set_tree_masks(masks)

    def bind(
        self, *, num_q_heads: int, kv_pool: KVPool, max_batch: int, max_pages_per_req: int,
        q_dtype: torch.dtype | None = None, fp8_math: bool = False,
    ) -> None:
        self._kernel = batch_invariant.kernel_fits(num_q_heads, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype,
                                                   self.device)
        self._g_heads = (num_q_heads, kv_pool.num_kv_heads, kv_pool.head_dim)
        self._cpu_kernel = (batch_invariant.enabled() and self.device.type == "cpu" and kv_pool.layout.is_gqa
                            and cpu_attention.fits(kv_pool.dtype, kv_pool.head_dim))  # builds it: before ready
        if self._kernel:
            self._block_tokens = batch_invariant.kernel_tokens(num_q_heads // kv_pool.num_kv_heads)
        self._g_page = kv_pool.page_size
        # deterministic inference on CUDA: decode is captured when the invariant kernel takes it,
        # through engine/run/cuda_graph.py's dense-table protocol (as mla_attention.MLABackend)
        self.supports_cuda_graph = batch_invariant.enabled() and self._kernel and kv_pool.layout.is_gqa
        if self.supports_cuda_graph:
            self.bind_graphs(max_batch, max_pages_per_req)
            if self.device.type == "cuda":
                self._warm_split(kv_pool, q_dtype or kv_pool.dtype)

    def _warm_split(self, kv_pool: KVPool, q_dtype: torch.dtype) -> None:
        """Compile the split-KV kernel pair now (warm-up's short prompts take the serial kernel
        only, and an eager decode past one partition would compile them mid-serving): a decode
        row of two partitions on the padding page, output discarded."""
        hq, _, d = self._g_heads
        n = batch_invariant.kv_part(kv_pool.page_size) + 1
        blocks = batch_invariant.DecodeBlocks(1, self.device, self._block_tokens).fill(
            torch.tensor([n], dtype=torch.int32, device=self.device), kv_pool.page_size)
        table = torch.full((1, -(-n // kv_pool.page_size)), PAD_PAGE, dtype=torch.int32, device=self.device)
        scratch = batch_invariant.split_scratch(1, 2, hq, d, self.device)
        q = torch.zeros(1, hq, d, dtype=q_dtype, device=self.device)
        batch_invariant.attend_blocks(q, blocks, table, kv_pool, 0, 2, scratch)

    def bind_graphs(self, max_batch: int, max_pages_per_req: int) -> None:
        """The static buffers a captured decode reads: lengths, a dense page table, the blocks."""
        self._g_seq = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self._g_table = torch.full((max_batch, max_pages_per_req), PAD_PAGE, dtype=torch.int32, device=self.device)
        # the graph runner sizes its staging buffers by this (a dense table of every row): its size only
        self._g_indices = torch.empty(max_batch * max_pages_per_req, dtype=torch.int32, device="meta")
        self._g_blocks = batch_invariant.DecodeBlocks(max_batch, self.device, self._block_tokens)
        # split-KV decode: the partitions of a row of the longest context, for the graph sizes
        # that split (split_rows: at most 16 rows with 8 KV heads)
        hq, hkv, d = self._g_heads
        self._g_parts = -(-max_pages_per_req * self._g_page // batch_invariant.kv_part(self._g_page))
        rows = min(max_batch, batch_invariant.split_rows(hkv)) if hkv else 0
        if rows and batch_invariant.splits(rows, hkv, self._g_parts) > 1:
            self._g_scratch = batch_invariant.split_scratch(rows, self._g_parts, hq, d, self.device)

    def uses_table(self, batch_size: int) -> bool:
        return True

    def graph_wrapper(self, bs: int) -> None:
        """Before capturing size `bs`: every row padding (one token on the padding page)."""
        empty = torch.empty(0, 1, dtype=torch.int32, device=self.device)
        self.set_graph_table(bs, empty[:, 0], empty)
        self._g_layer = None  # the first layer its forward attends rebuilds the blocks
        # the grid is fixed at capture: programs past a replay's partitions store nothing
        fits = self._g_scratch is not None and bs <= self._g_scratch[0].shape[0]
        self._g_splits = batch_invariant.splits(bs, self._g_heads[1], self._g_parts) if fits else 1

    def set_graph_table(self, bs: int, seq_lens: torch.Tensor, table: torch.Tensor) -> None:
        """This step's seq_lens int32 [b] and page table int32 [b, w] (device) into the static
        buffers the graph of size `bs` reads; rows b..bs become padding. Columns past w hold the
        padding page, as in an eager batch's table."""
        b, w = table.shape
        self._g_seq[:b].copy_(seq_lens)
        self._g_table[:b, :w].copy_(table)
        self._g_table[:b, w:].fill_(PAD_PAGE)
        if b < bs:
            self._g_seq[b:bs].fill_(1)
            self._g_table[b:bs].fill_(PAD_PAGE)
        self._graph = (self._g_table[:bs], self._g_seq[:bs])

    def attend_qkv(
        self, qkv: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor | None:
        """Deterministic inference's captured split-KV decode takes the prologue in its split kernel,
        with qk_norm_rope_store's bits (RoPE only: a q/k norm's sum would reduce in another order in
        the split kernel's tile): a launch a layer fewer (H100, docs/PERF.md, fortieth session). Qwen3's
        q/k norms taken too (both kernels' sums in one explicit order) measured even at batch 1 and
        slower at batch 8 (fiftieth session): not taken."""
        if self._graph is None or self._g_splits <= 1 or q_norm_weight is not None:
            return None
        hq, hkv, d = self._g_heads
        return batch_invariant.attend_blocks(qkv.view(qkv.shape[0], hq + 2 * hkv, d), self._graph_blocks(layer_id),
                                             self._graph[0], kv_pool, layer_id, self._g_splits, self._g_scratch,
                                             cos_sin_cache)

    def _graph_attend(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool) -> torch.Tensor:
        """A decode step in a CUDA graph (its capture and warm-up): one kernel block per row, the
        blocks rebuilt from the static lengths by device ops in the forward's first attention
        layer, so that a replay rebuilds them; the same bits as the eager plan's blocks."""
        return batch_invariant.attend_blocks(q, self._graph_blocks(layer_id), self._graph[0], kv_pool, layer_id,
                                             self._g_splits, self._g_scratch)

    def _graph_blocks(self, layer_id: int) -> tuple[torch.Tensor, ...]:
        """The captured step's kernel blocks, rebuilt from the static lengths in the forward's first
        attention layer (so that a replay rebuilds them)."""
        if self._g_layer is None:
            self._g_layer = layer_id
        if layer_id == self._g_layer:
            self._g_now = self._g_blocks.fill(self._graph[1], self._g_page)
        return self._g_now

    def prepare(self, batch: ForwardBatch) -> None:
        lens, seqs = batch.extend_lens_cpu, batch.seq_lens_cpu
        trees = self.take_trees()
        self._graph = None  # an eager step: attention reads the batch's page table
        if self._cpu_kernel:
            hq, hkv, _ = self._g_heads
            self._cpu_plan = cpu_attention.plan(batch.page_table, seqs, lens, hkv, hq // hkv)
            return
        if batch_invariant.enabled():
            self._invariant = self._invariant_plans(batch)
            return
        decode_reqs = [i for i, n in enumerate(lens) if n == 1]
        row_starts = [0]
        for n in lens:
            row_starts.append(row_starts[-1] + n)
        self._decode = self._decode_group(batch, decode_reqs, row_starts) if decode_reqs else None
        self._all_decode = len(decode_reqs) == len(lens)  # then the decode rows are 0..T-1 in order
        extend_reqs = [[i] for i, n in enumerate(lens) if n > 1]
        if self.device.type == "cpu":  # fresh prefills of one length in a row: one batched SDPA call
            extend_reqs = self._fresh_runs(batch, extend_reqs)
        self._extends = [self._extend_req(batch, reqs, row_starts[reqs[0]], seqs[reqs[0]], trees.get(reqs[0]))
                         for reqs in extend_reqs]

    def _invariant_plans(self, batch: ForwardBatch) -> list[batch_invariant.Plan]:
        """The step's deterministic plans: one for the CUDA kernel; on the torch path, decode rows
        in blocks of decode_tokens' few tokens and the others in blocks of TOKENS, two plans where a
        step has both (a decode row then computes its own token's rows, not TOKENS' worth)."""
        lens, seqs, ps = batch.extend_lens_cpu, batch.seq_lens_cpu, batch.page_size
        hq, hkv, d = self._g_heads
        if self._kernel or not hkv:  # (a bare backend, not bound: TOKENS)
            return [batch_invariant.plan(batch.page_table, seqs, lens, ps, self._kernel, self._block_tokens)]
        few = batch_invariant.decode_tokens(hq // hkv, d, d, batch_invariant.kv_chunk(ps), self.device)
        decodes = sum(n == 1 for n in lens)
        if decodes == len(lens) and lens:
            kinds = [(None, few)]
        elif decodes and few < batch_invariant.TOKENS:
            kinds = [(False, batch_invariant.TOKENS), (True, few)]
        else:
            kinds = [(None, batch_invariant.TOKENS)]
        return [batch_invariant.plan(batch.page_table, seqs, lens, ps, tokens=tokens, decodes=dec,
                                     group_chunks=batch_invariant.group_chunks(hq, tokens, d, ps))
                for dec, tokens in kinds]

    @staticmethod
    def _fresh_runs(batch: ForwardBatch, reqs: list[list[int]]) -> list[list[int]]:
        """Merge consecutive requests (adjacent rows) that are fresh prefills (no cached prefix)
        of the same length: SDPA over [count, H, L, D] gives each the values of its own call (the
        same flash kernel per request and head) with one gather and one call a layer instead of
        `count` (16 x 128-token prompts: 7.8 vs 10.3 ms a layer)."""
        lens, seqs = batch.extend_lens_cpu, batch.seq_lens_cpu
        runs: list[list[int]] = []
        for (i,) in reqs:
            last = runs[-1][-1] if runs else None
            fresh = seqs[i] == lens[i]
            if last is not None and fresh and last == i - 1 and seqs[last] == lens[last] == lens[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    @staticmethod
    def _pages(batch: ForwardBatch, reqs: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Pages covering positions 0..kv_len-1 of each request in `reqs`: int64 [len(reqs), n]."""
        n = -(-kv_len // batch.page_size)
        return batch.page_table[reqs][:, :n].to(torch.int64)

    def _decode_group(self, batch: ForwardBatch, reqs: list[int], row_starts: list[int]) -> _DecodeGroup:
        dev = batch.page_table.device
        req_t = torch.tensor(reqs, dtype=torch.int64, device=dev)
        pages = self._pages(batch, req_t, max(batch.seq_lens_cpu[i] for i in reqs))
        pos = torch.arange(pages.shape[1] * batch.page_size, device=dev)
        mask = pos[None, :] < batch.seq_lens[req_t].to(torch.int64)[:, None]
        rows = torch.tensor([row_starts[i] for i in reqs], dtype=torch.int64, device=dev)
        return _DecodeGroup(rows=rows, pages=pages, mask=mask[:, None, None, :])

    def _extend_req(self, batch: ForwardBatch, reqs: list[int], row_start: int, seq_len: int,
                    tree: torch.Tensor | None = None) -> _ExtendReq:
        n = batch.extend_lens_cpu[reqs[0]]
        start = seq_len - n
        req_t = torch.tensor(reqs, dtype=torch.int64, device=batch.page_table.device)
        pages = self._pages(batch, req_t, seq_len)
        mask = None
        if tree is not None:  # a draft tree: the cached prefix, then the tree's own mask
            tree = tree.to(pages.device)
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=pages.device), tree], dim=1)
        elif start > 0 and not self._split_prefix:
            # with a cached prefix the causal diagonal is shifted right by `start`
            q_pos = torch.arange(start, seq_len, device=pages.device)
            mask = torch.arange(seq_len, device=pages.device)[None, :] <= q_pos[:, None]
        return _ExtendReq(row_start=row_start, row_end=row_start + n * len(reqs), pages=pages, seq_len=seq_len,
                          start=start, mask=mask, count=len(reqs))

    @property
    def _split_prefix(self) -> bool:
        """Whether a chunk with a cached prefix runs as prefix + causal parts (CPU flash with LSE)."""
        return self.device.type == "cpu" and _CPU_FLASH_LSE is not None

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        if self._graph is not None:
            return self._graph_attend(q, layer_id, kv_pool)
        if self._cpu_plan is not None:
            out_dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
            o = cpu_attention.attend(q, self._cpu_plan, kv_pool.k[layer_id], kv_pool.v[layer_id], kv_pool.page_size,
                                     q.shape[-1] ** -0.5, out_dtype=out_dtype)
            return o.to(q.dtype)
        if self._invariant is not None:
            out = None
            for p in self._invariant:
                out = batch_invariant.attend(q, p, kv_pool, layer_id, out)
            return out
        if self._decode is not None:
            g = self._decode
            qd = q if self._all_decode else q[g.rows]
            if self.device.type == "cpu":  # the KV read as stored, GQA groups as query rows
                kg, vg = kv_pool.gather_pages(layer_id, g.pages, q.dtype)
                if g.bias is None or g.bias.dtype != q.dtype:  # once a step, not once a layer inside SDPA
                    g.bias = torch.zeros(g.mask.shape, dtype=q.dtype).masked_fill_(~g.mask, float("-inf"))
                o = _decode_sdpa_grouped(qd, kg, vg, g.bias)
            elif q.dtype == torch.float32:  # GPU, fp32 (the reference path): SDPA's flash kernel
                kg, vg = kv_pool.gather_pages(layer_id, g.pages, q.dtype)
                kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [b, Hkv, Lk, D]
                o = F.scaled_dot_product_attention(qd.unsqueeze(2), kg, vg, attn_mask=g.mask, enable_gqa=True)
                o = o.squeeze(2)
            else:  # bf16/fp16 (GPU): two GEMMs in fp32, 4x faster than masked SDPA at one query row
                kg, vg = kv_pool.gather_pages(layer_id, g.pages, torch.float32)
                o = _decode_attention(qd, kg, vg, g.mask).to(q.dtype)
            if self._all_decode:  # a decode-only step: no scatter into a separate output
                return o
            out = torch.empty_like(q)
            out[g.rows] = o
        else:
            out = torch.empty_like(q)
        for e in self._extends:
            if e.count > 1:  # fresh prefills of one length: [count, H, L, D]
                _, hq, d = q.shape
                qe = q[e.row_start : e.row_end].view(e.count, e.seq_len, hq, d).transpose(1, 2)
                ke, ve = kv_pool.gather_pages(layer_id, e.pages, q.dtype)
                ke, ve = ke[:, : e.seq_len].transpose(1, 2), ve[:, : e.seq_len].transpose(1, 2)
                o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
                out[e.row_start : e.row_end].view(e.count, e.seq_len, hq, d).copy_(o.transpose(1, 2))
                continue
            qe = q[e.row_start : e.row_end].transpose(0, 1)  # [Hq, Lq, D]
            ke, ve = kv_pool.gather_pages(layer_id, e.pages, q.dtype)
            ke, ve = ke[0, : e.seq_len].transpose(0, 1), ve[0, : e.seq_len].transpose(0, 1)  # [Hkv, Lk, D]
            if e.mask is not None:  # (a draft tree's, or a chunk's after a cached prefix)
                o = _sdpa4(qe, ke, ve, attn_mask=e.mask)
            elif e.start == 0:
                o = _sdpa4(qe, ke, ve, is_causal=True)
            else:
                o = _prefix_then_causal(qe, ke, ve, e.start)
            out[e.row_start : e.row_end] = o.transpose(0, 1)
        return out


# name -> (module, class); imported lazily so optional GPU kernels stay optional
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("engine.layers.attention", "TorchAttention"),
    "flashinfer": ("engine.layers.flashinfer_attention", "FlashInferAttention"),
}
_CUDA_ONLY = {"flashinfer"}


def available_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def create_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Instantiate backend `name` ("auto", "torch", "flashinfer") for `device`.

    "auto" is torch on CPU; on CUDA it is flashinfer when that backend is installed and
    implemented, else torch with a warning. Raises ValueError for an unknown name and
    RuntimeError when an explicitly named backend cannot be loaded.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return TorchAttention(device)
        try:
            return _load("flashinfer", device)
        except RuntimeError as e:
            log.warning("attention backend fallback", wanted="flashinfer", using="torch", reason=str(e))
            return TorchAttention(device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {available_backends()}")
    if name in _CUDA_ONLY and device.type != "cuda":
        raise RuntimeError(
            f"attention backend {name!r} is not available on {device.type}: it needs a CUDA device; "
            f"use --attention-backend torch (or auto)"
        )
    return _load(name, device)


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The backend `create_backend(name, device)` aims for, without importing it ("auto":
    torch on CPU, flashinfer on CUDA). Raises like create_backend for bad names/devices."""
    device = torch.device(device)
    if name == "auto":
        return "flashinfer" if device.type == "cuda" else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {available_backends()}")
    if name in _CUDA_ONLY and device.type != "cuda":
        raise RuntimeError(f"attention backend {name!r} needs a CUDA device, got {device.type}")
    return name


def _load(name: str, device: torch.device) -> AttentionBackend:
    module, cls_name = _BACKENDS[name]
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"attention backend {name!r} is not available ({module}.{cls_name}: {e}); "
            f"use --attention-backend torch"
        ) from e
    return cls(device)
