"""FlashInfer attention over the paged KV pool (CUDA only; flashinfer is imported lazily).

The pool's flat slot buffers [num_pages * page_size, Hkv, D] are viewed as
[num_pages, page_size, Hkv, D] (NHD) and handed to flashinfer as (k_cache, v_cache).

Per step, `prepare` builds the paged-KV metadata (kv_indptr, kv_indices, kv_last_page_len,
and qo_indptr for ragged queries) on the host from the batch's CPU page table and lengths,
and calls `plan()` once on the wrapper that fits the batch:

* pure decode (every request extends by one token): BatchDecodeWithPagedKVCacheWrapper with
  tensor cores (the GQA-friendly kernel);
* anything with an extend > 1 (prefill, chunked prefill with a cached prefix, mixed with
  decodes): BatchPrefillWithPagedKVCacheWrapper, causal (bottom-right aligned, so a chunk
  attends to its whole prefix), ragged queries through qo_indptr. A step with speculative
  draft trees (`set_tree_masks`) plans it with a custom mask instead (`packed_tree_mask`).

`attend` per layer runs the planned kernel (the K/V are already in their slots).

Decode batches may instead run flashinfer's XQA kernel (TensorRT-LLM's decode attention;
on SM90 with an fp8 KV cache its GMMA kernel reads fp8 at ~3.8 TB/s where the tensor-core
decode above stays at the bf16 step time). XQA needs no plan: it reads the dense page
table [B, W] and the KV lengths on the device, splits long sequences across CTAs and
merges them in the same launch. Small decode batches may run our triton kernel
(engine/layers/triton_ops.decode_attention), which reads the same dense table and does the
layer's whole attention in one launch: the q/k norm + RoPE + K/V store prologue (the model
hands it the QKV projection through `attend_qkv`), split-KV attention and the merge.
Which one runs at which batch size comes from the GPU's tuning file (engine/layers/tuning.py,
configs/tuning/): on an H200 (bench/results/attn_probe-h200.json) with bf16 KV XQA is faster
at batch 1 on its own but made the served step slower, and is slower at batch 256; with fp8
KV it is faster everywhere (2x with --attention-fp8-math). `--decode-kernel` overrides it
(`set_decode_kernel`, called by the runner before `bind`).

CUDA graphs (engine/run/cuda_graph.py): `graph_wrapper(bs)` builds a decode wrapper with
use_cuda_graph=True over fixed buffers (indptr [bs+1], last_page_len [bs], and one shared
indices buffer sized max_batch * max_pages_per_req); `plan_graph_arrays` re-plans it before
each replay from the padded metadata CudaGraphRunner.run_decode builds (padded rows on the
padding page 0); the dense-table kernels take `set_graph_table` instead.

plan() writes its schedule into a pinned host buffer and copies it to the device
asynchronously. With two steps in flight, the next plan could overwrite that buffer before
the copy ran, so two pinned buffers alternate, each reused only after an event recorded
behind its copy has completed (normally long since).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers import triton_ops
from engine.layers.attention import AttentionBackend
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import PAD_PAGE, KVPool
from engine.layers.tuning import DECODE_KERNELS, KernelTuning, kernel_tuning

WORKSPACE_BYTES = 256 << 20  # float workspace (split-KV partial results), shared by all wrappers
_INT_WORKSPACE_BYTES = 8 << 20  # flashinfer's own int workspace size (its staging must match)
# fa2 prefill is the very module tensor-core decode uses: one JIT compile serves both (fa3 and
# flashinfer's "auto" were the losing side of that choice)
PREFILL_BACKEND = "fa2"
# Decode always uses tensor cores: flashinfer's CUDA-core decode kernel measured slower on an
# H200 for bf16 at batch 1-8 (latency-*-cudacore-decode-small-batch.json) and for fp8 KV.
XQA_PAGE_SIZES = (16, 32, 64, 128)
_XQA_SEMAPHORE_BYTES = 8 << 20
_XQA_SCRATCH_BYTES = 56 << 20


def xqa_supported(capability: tuple[int, int], q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  head_dim: int, page_size: int) -> bool:
    """Whether flashinfer's XQA decode kernel takes this geometry (SM90/100/120, half
    queries, KV of the query dtype or fp8 e4m3, head_dim a multiple of 16 up to 256)."""
    return (
        capability[0] in (9, 10, 12)
        and q_dtype in (torch.float16, torch.bfloat16)
        and kv_dtype in (q_dtype, torch.float8_e4m3fn)
        and head_dim % 16 == 0
        and 16 <= head_dim <= 256
        and page_size in XQA_PAGE_SIZES
    )


def triton_decode_supported(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                            num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether engine/layers/triton_ops.decode_attention takes this geometry (CUDA with triton, half
    queries, KV of the query dtype or fp8 e4m3, a power-of-two head_dim, a GQA group <= 16)."""
    return (
        device.type == "cuda" and triton_ops.available()
        and q_dtype in (torch.float16, torch.bfloat16) and kv_dtype in (q_dtype, torch.float8_e4m3fn)
        and 16 <= head_dim and head_dim & (head_dim - 1) == 0
        and num_q_heads // num_kv_heads <= triton_ops.DECODE_BLOCK_H
    )


def set_decode_kernel(backend: AttentionBackend, mode: str) -> None:
    """--decode-kernel: "auto" (the GPU's tuning file) or a kernel name forced for every decode
    batch where it is supported (debugging). Call before bind(). Only the flashinfer backend has
    decode kernels to choose from; naming one for another backend is an error, not a no-op."""
    if mode != "auto" and mode not in DECODE_KERNELS:
        raise ValueError(f"--decode-kernel must be auto or one of {', '.join(DECODE_KERNELS)}, got {mode!r}")
    if isinstance(backend, FlashInferAttention):
        backend.decode_mode = mode
    elif mode != "auto":
        raise ValueError(f"--decode-kernel {mode} needs the flashinfer attention backend, "
                         f"not {type(backend).__name__}")


class _Staging:
    """Two pinned plan-staging buffers used alternately (see the module docstring)."""

    def __init__(self, nbytes: int) -> None:
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.i = 0

    def take(self) -> torch.Tensor:
        self.i ^= 1
        ev = self.events[self.i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer: done long ago in practice
        return self.bufs[self.i]

    def release(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.i] = ev

    def plan(self, wrapper, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        """wrapper.plan(*args, **kwargs) staged through the next buffer (a wrapper of flashinfer's
        GQA kind, whose int workspace these buffers mirror)."""
        wrapper._pin_memory_int_workspace_buffer = self.take()
        wrapper.plan(*args, **kwargs)
        self.release()


def paged_kv_metadata(
    seq_lens: list[int], page_table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr int32 [B+1], kv_indices int32 [nnz], kv_last_page_len int32 [B]) on the CPU,
    from the CPU page table [B, W] (row i's first ceil(seq_lens[i]/page_size) entries)."""
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    npages = (seq + (page_size - 1)) // page_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(npages, 0)
    last = seq - (npages - 1) * page_size
    width = page_table.shape[1]
    mask = torch.arange(width, dtype=torch.int32)[None, :] < npages[:, None]
    return indptr, page_table[mask].to(torch.int32), last


def pad_metadata(
    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append `pad` dummy requests of one token each on the padding page (CUDA-graph rows)."""
    if pad <= 0:
        return indptr, indices, last
    extra = indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)
    return (
        torch.cat([indptr, extra]),
        torch.cat([indices, torch.full((pad,), PAD_PAGE, dtype=torch.int32)]),
        torch.cat([last, torch.ones(pad, dtype=torch.int32)]),
    )


def packed_tree_mask(extend_lens: list[int], seq_lens: list[int],
                     trees: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer's custom mask for a step with draft trees: request i's n new tokens (after its
    seq_len - n cached ones) see, causally, their prefix, or for a tree request the whole cached
    prefix and, among themselves, what trees[i] (bool [n, n]) allows. The kernel reads request
    i's [n, seq_len] bits row-major, little-endian, from byte mask_indptr[i] (flashinfer's
    attention/variants.cuh), so each request's bits start on a byte. Returns (the bytes uint8,
    the byte offsets int32 [B + 1]), on the host."""
    parts, offsets = [], [0]
    for i, (n, kv) in enumerate(zip(extend_lens, seq_lens, strict=True)):
        tree = trees.get(i)
        if tree is None:
            bits = causal_bits(n, kv)
        else:
            m = torch.ones(n, kv, dtype=torch.bool)
            m[:, kv - n:] = tree
            bits = np.packbits(m.numpy().reshape(-1), bitorder="little")
        parts.append(bits)
        offsets.append(offsets[-1] + bits.size)
    return torch.from_numpy(np.concatenate(parts)), torch.tensor(offsets, dtype=torch.int32)


def causal_bits(n: int, kv: int) -> np.ndarray:
    """np.packbits (little-endian) of the causal [n, kv] mask of n new tokens after kv - n cached
    ones, built a byte at a time: row r's ones are bits [r kv, r kv + kv - n + r + 1) of the flat
    stream, so its whole bytes are one run of 0xFF (np.repeat of alternating runs) and its two
    edge bytes are ORed in (an edge byte may hold two rows' bits; with kv >= 8 no two rows share
    a head byte, nor a tail byte): ~10x faster than packing the [n, kv] bools, which took 81 ms
    for an 8k-token chunk at 8k context beside a draft tree (docs/architecture.md, Speculative
    decoding)."""
    if kv < 8:  # rows share bytes: the plain way (a few bytes)
        m = np.arange(kv)[None, :] <= np.arange(kv - n, kv)[:, None]
        return np.packbits(m.reshape(-1), bitorder="little")
    rows = np.arange(n, dtype=np.int64)
    start = rows * kv
    end = start + kv - n + rows + 1  # exclusive; every row holds at least one bit
    first = (start + 7) // 8
    past = np.maximum(end // 8, first)  # the row's whole bytes: first .. past - 1 (maybe none)
    bounds = np.empty(2 * n + 2, dtype=np.int64)
    bounds[0], bounds[1:-1:2], bounds[2:-1:2], bounds[-1] = 0, first, past, (n * kv + 7) // 8
    runs = np.zeros(2 * n + 1, dtype=np.uint8)
    runs[1::2] = 0xFF  # zeros before row 0's whole bytes, row 0's, zeros, row 1's, ...
    out = np.repeat(runs, np.diff(bounds))
    head, tail = start // 8, (end - 1) // 8
    lo, hi = start % 8, (end - 1) % 8  # the row's first and last bit in those bytes
    one = head == tail
    span = np.where(one, hi - lo + 1, 8 - lo)
    out[head] |= (((1 << span) - 1) << lo).astype(np.uint8)
    out[tail[~one]] |= ((1 << (hi[~one] + 1)) - 1).astype(np.uint8)
    return out


class FlashInferAttention(AttentionBackend):
    supports_cuda_graph = True
    takes_tree_masks = True  # the prefill wrapper's custom mask (packed_tree_mask)
    decode_mode = "auto"  # --decode-kernel (set_decode_kernel): auto = the tuning's rules

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeError(
                f"the flashinfer attention backend needs a CUDA device, got {self.device}; "
                "use --attention-backend torch"
            )
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(f"flashinfer is not installed ({e}); use --attention-backend torch") from e
        self._fi = flashinfer
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._staging = _Staging(_INT_WORKSPACE_BYTES)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=PREFILL_BACKEND
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self._active = None  # the wrapper planned for the current step
        # (table, seq_lens) when this step's decode kernel reads the dense page table (XQA, triton)
        self._table_args: tuple[torch.Tensor, torch.Tensor] | None = None
        self._table_kernel = "fa2"
        self._bound = False
        self._graph: dict[int, object] = {}

    # ---- geometry (once) ----

    def bind(
        self, *, num_q_heads: int, kv_pool: KVPool, max_batch: int, max_pages_per_req: int,
        q_dtype: torch.dtype | None = None, fp8_math: bool = False,
    ) -> None:
        if num_q_heads % kv_pool.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {kv_pool.num_kv_heads} KV heads")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.page_size = kv_pool.page_size
        self.dtype = kv_pool.dtype
        self.q_dtype = q_dtype or kv_pool.dtype
        self.kv_pool = kv_pool
        self.fp8_math = fp8_math
        self._kv = [kv_pool.page_view(layer) for layer in range(kv_pool.num_layers)]
        self.max_batch = max_batch
        self.max_pages_per_req = max_pages_per_req
        # CUDA-graph decode buffers, shared by every captured batch size (each wrapper uses a
        # prefix; replays run in stream order, each after its own plan)
        self._g_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device)
        self._g_last = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self._g_indices = torch.zeros(max(1, max_batch * max_pages_per_req), dtype=torch.int32, device=self.device)
        self._g_table: torch.Tensor | None = None  # the dense-table kernels' graph inputs (_init_table)
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)
        self._xqa_ok = xqa_supported(cap, self.q_dtype, self.dtype, self.head_dim, self.page_size)
        self.tuning: KernelTuning = kernel_tuning(self.device)
        self._triton_ok = triton_decode_supported(self.device, self.q_dtype, self.dtype, num_q_heads,
                                                  self.num_kv_heads, self.head_dim)
        self._sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 8
        )
        if self._xqa_ok and self._may_use("xqa"):  # compiles XQA's module: only where it can run
            from flashinfer.xqa import get_xqa_module

            group = self.num_q_heads // self.num_kv_heads
            module = get_xqa_module(self.q_dtype, self.dtype, self.page_size, self.head_dim, group, False,
                                    self.q_dtype, 1)
            self._init_xqa(module.xqa)
        if self._triton_ok and self._may_use("triton"):
            self._init_triton()
        self._bound = True

    def _may_use(self, kernel: str) -> bool:
        """Whether some decode batch may run `kernel` (forced, or in the tuning's rules)."""
        if self.decode_mode != "auto":
            return self.decode_mode == kernel
        return self.tuning.max_decode_batch(kernel, self.dtype) != 0

    def _init_table(self) -> None:
        """CUDA-graph inputs of the dense-table kernels: page-table rows and KV lengths
        (padding rows: the padding page, one token)."""
        if self._g_table is None:
            self._g_table = torch.zeros(self.max_batch, self.max_pages_per_req, dtype=torch.int32,
                                        device=self.device)
            self._g_seq = torch.ones(self.max_batch, dtype=torch.int32, device=self.device)

    def _init_triton(self) -> None:
        """The triton decode kernel's split workspace (batches up to the tuning's limit for it, or
        every batch when it is forced)."""
        top = self.tuning.max_decode_batch("triton", self.dtype) if self.decode_mode == "auto" else None
        top = self.max_batch if top is None else min(self.max_batch, top)
        self._triton_ws = triton_ops.decode_workspace(top, self.num_kv_heads, self.head_dim, self._sm_count,
                                                      self.device)
        self._init_table()

    def _init_xqa(self, xqa_fn) -> None:  # noqa: ANN001 - flashinfer's compiled xqa op or a stand-in
        """xqa_fn(run_sm90_fp8_mha, sm_count, num_kv_heads, sliding_window, q_scale, out, rcp_out_scale,
        q, sinks, k_cache, v_cache, k_sf, v_sf, page_table, max_seq_len, seq_lens, batch, kv_scale,
        semaphores, scratch, enable_pdl, q_seq_len, mask): the op flashinfer.xqa.xqa wraps."""
        self._xqa_fn = xqa_fn
        # fp8 KV on SM90 with --attention-fp8-math: the GMMA kernel, which also rounds q and the
        # probabilities to fp8 (2x faster); otherwise the generic kernel widens fp8 K/V to q's dtype
        self._xqa_fp8_gmma = self.fp8_math and self.dtype.itemsize == 1 and self.device.type == "cuda" \
            and torch.cuda.get_device_capability(self.device)[0] == 9
        # semaphores must start at zero (the kernel leaves them so): never shared with FA2
        self._xqa_ws = torch.zeros(_XQA_SEMAPHORE_BYTES + _XQA_SCRATCH_BYTES, dtype=torch.uint8, device=self.device)
        self._init_table()

    def decode_kernel(self, batch_size: int) -> str:
        """The kernel a decode batch of this (padded) size runs: "fa2", "xqa" or "triton"."""
        return self.tuning.decode_kernel(self.decode_mode, self._xqa_ok, self._triton_ok, self.dtype, batch_size)

    def uses_table(self, batch_size: int) -> bool:
        """Whether that kernel reads the dense page table (set_graph_table) instead of a plan."""
        return self.decode_kernel(batch_size) != "fa2"

    def _plan_kwargs(self) -> dict:
        return dict(q_data_type=self.q_dtype, kv_data_type=self.dtype)

    def _plan(self, wrapper, *args, **kwargs) -> None:  # noqa: ANN001
        self._staging.plan(wrapper, *args, **kwargs)

    # ---- per step ----

    def prepare(self, batch: ForwardBatch) -> None:
        if not self._bound:
            raise RuntimeError("FlashInferAttention.bind() must be called before prepare()")
        if batch.page_table_cpu is None:
            raise ValueError("flashinfer attention needs ForwardBatch.page_table_cpu (build the batch with build())")
        trees = self.take_trees()
        if batch.is_decode and self.uses_table(batch.batch_size):
            self._use_table(batch.page_table, batch.seq_lens)
            return
        self._use_plan()
        indptr, indices, last = paged_kv_metadata(batch.seq_lens_cpu, batch.page_table_cpu, batch.page_size)
        hq, hkv, d, ps = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size
        if batch.is_decode:
            self._plan(self._decode, indptr, indices, last, hq, hkv, d, ps, **self._plan_kwargs())
            self._active = self._decode
        else:
            qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), 0)
            mask: dict = {}
            if trees:
                packed, offsets = packed_tree_mask(batch.extend_lens_cpu, batch.seq_lens_cpu, trees)
                # (non_blocking: a blocking copy waits for the steps queued on the device)
                mask = dict(packed_custom_mask=packed.to(self.device, non_blocking=True))
            # the longest new span, known here: flashinfer's own max() walks the tensor element by
            # element (1-2 ms of the worker's thread per 256-row mixed step in an H200 profile)
            self._plan(
                self._prefill, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=not trees,
                max_token_per_sequence=max(batch.extend_lens_cpu), **mask, **self._plan_kwargs(),
            )
            if trees:  # plan() takes a packed mask's offsets in bits; its kernel reads them in bytes
                self._prefill._mask_indptr_buf = offsets.to(self.device, non_blocking=True)
            self._active = self._prefill

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool) -> torch.Tensor:
        if self._table_kernel == "xqa":
            return self._xqa(q, layer_id, *self._table_args)
        if self._table_kernel == "triton":
            return self._triton(q.reshape(q.shape[0], -1), layer_id, batch.positions)
        return self._active.run(q, self._kv[layer_id])

    def attend_qkv(
        self, qkv: torch.Tensor, layer_id: int, batch: ForwardBatch, kv_pool: KVPool, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor | None:
        if self._table_kernel != "triton":
            return None
        return self._triton(qkv, layer_id, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)

    def _triton(self, x: torch.Tensor, layer_id: int, positions: torch.Tensor, *prologue) -> torch.Tensor:  # noqa: ANN002
        """The triton decode kernel over the dense table (triton_ops.decode_attention), with the
        prologue when given (cos_sin_cache, q_norm_weight, k_norm_weight, eps)."""
        return triton_ops.decode_attention(
            x, self.num_q_heads, self.num_kv_heads, self.head_dim, positions, self._table_args[0],
            self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], self.page_size, self._triton_ws,
            self._triton_splits, *prologue, parts=self._triton_parts,
        )

    def _use_table(self, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """This step's decode runs a dense-table kernel (XQA or triton) over table [B, W] and
        seq_lens [B]; the per-step choices are made here once, not per layer."""
        b = table.shape[0]
        self._table_args = (table, seq_lens)
        self._table_kernel = self.decode_kernel(b)
        self._triton_splits = triton_ops.decode_splits(b, self.num_kv_heads, self._sm_count)
        self._triton_parts = triton_ops.decode_parts(b, self.num_q_heads, self.num_kv_heads, self._triton_splits,
                                                     self._sm_count)

    def _use_plan(self) -> None:
        """This step runs a planned flashinfer wrapper (self._active)."""
        self._table_args, self._table_kernel = None, "fa2"

    def _xqa(self, q: torch.Tensor, layer_id: int, table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """XQA decode: q [B, Hq, D] over the pages in table [B, W] (int32; W * page_size is the
        kernel's max length) and seq_lens int32 [B]. Scales 1.0: the kernel applies 1/sqrt(D)."""
        b = q.shape[0]
        q = q.contiguous()
        out = torch.empty_like(q)
        k, v = self._kv[layer_id]
        ws = self._xqa_ws
        self._xqa_fn(
            self._xqa_fp8_gmma, self._sm_count, self.num_kv_heads, 0, 1.0,
            out.view(b, 1, self.num_q_heads, self.head_dim), 1.0, q.view(b, 1, self.num_q_heads, self.head_dim),
            None, k, v, None, None, table, table.shape[1] * self.page_size, seq_lens.view(b, 1), b, 1.0,
            ws[:_XQA_SEMAPHORE_BYTES], ws[_XQA_SEMAPHORE_BYTES:], False, 1, None,
        )
        return out

    # ---- CUDA graphs (decode) ----

    def graph_wrapper(self, bs: int):  # noqa: ANN201
        """The fixed-size decode wrapper for padded batch size `bs` (created once), planned
        with dummy rows (all on the padding page) and made active, ready for capture."""
        if bs > self.max_batch:
            raise ValueError(f"graph batch {bs} exceeds max_batch {self.max_batch}")
        if self.uses_table(bs):  # no wrapper: the graph reads the static table and lengths
            empty = torch.empty(0, 1, dtype=torch.int32, device=self.device)
            self.set_graph_table(bs, empty[:, 0], empty)  # every row padding until the first replay
            return None
        self._use_plan()
        w = self._graph.get(bs)
        if w is None:
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last[:bs],
            )
            self._graph[bs] = w
        indptr = torch.arange(bs + 1, dtype=torch.int32)
        indices = torch.full((bs,), PAD_PAGE, dtype=torch.int32, device=self.device)
        last = torch.ones(bs, dtype=torch.int32)
        self._plan(w, indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim,
                   self.page_size, **self._plan_kwargs())
        self._active = w
        return w

    def plan_graph_arrays(self, bs: int, indptr: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> None:
        """Plan the captured wrapper of size `bs` from padded metadata: indptr [bs+1] and
        last [bs] on the host (int32), indices [nnz] already on the device (int32)."""
        w = self._graph[bs]
        self._plan(w, indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim,
                   self.page_size, **self._plan_kwargs())
        self._active = w
        self._use_plan()

    def set_graph_table(self, bs: int, seq_lens: torch.Tensor, table: torch.Tensor) -> None:
        """Point the XQA or triton graph of size `bs` at this step: seq_lens int32 [b] and table int32
        [b, w] (b <= bs, w <= max_pages_per_req) on the device; rows b..bs become padding (one
        token on the padding page). Columns past each row's pages are never read."""
        b, w = table.shape
        self._g_seq[:b].copy_(seq_lens)
        self._g_table[:b, :w].copy_(table)
        if b < bs:
            self._g_seq[b:bs].fill_(1)
            self._g_table[b:bs, 0].fill_(PAD_PAGE)
        self._use_table(self._g_table[:bs], self._g_seq[:bs])
