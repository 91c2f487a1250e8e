"""flashinfer's MLA decode (BatchMLAPagedAttentionWrapper) over our latent pool (CUDA; flashinfer
is imported when a rank chooses it).

Why: on an H200 it ran DeepSeek-V3's decode attention at 128 heads a rank 3.0-3.6x faster than
our triton kernel (engine/layers/mla_kernels.py) at every batch (1-128) and context (1k-32k)
measured (docs/PERF.md, bench/results/mla-decode-h200-0d64ad3.json). Which ranks take it is the
GPU's tuning (KernelTuning.mla_flashinfer_min_heads); only where `flashinfer_mla_supported`: bf16
or fp16 latents of kv_lora_rank 512 + rope 64 (the geometry its kernels are built and tested for:
DeepSeek-V2/V3, Kimi-K2), queries of the latent's dtype (an fp8 pool keeps our kernel: not measured).

The pool (KVPool, layout latent: [slots, 1, 512 + 64] per layer) is handed over without a copy:
viewed as [pages, page_size, 576], ckv = [..., :512] and kpe = [..., 512:] are strided views (the
kernel takes a page stride and a token stride for each; bin/bench mla's "views" layout).

plan() schedules the work on the host from host qo_indptr, kv_indptr (pages) and kv_len (tokens),
and copies the schedule into the wrapper's int workspace; run() reads that schedule and kv_indices
on the device, nothing else (not the indptr/len buffers). Its schedule's layout depends only on
the head count, so a wrapper captured in a CUDA graph can be re-planned for any lengths.

The geometry (kv_lora_rank, rope dims, softmax scale with YaRN's mscale) is the model's, which the
attention backend does not see: a plan asked for before the step's first layer (an eager step's
`prepare`, `graph_wrapper` before a capture) is held pending and made by the first `run` of the
step (layer 0), which learns the geometry; CUDA graphs: the capture's warm-up forwards make the
dummy plan, and each replay is planned by `plan_graph` (geometry known by then) before it.

Host buffers: the plan's pinned staging buffer alternates between two (flashinfer_attention's
_Staging: the next plan must not overwrite a buffer whose copy has not run); a graph plan's KV
lengths are written into the tail of that same pinned buffer, so they share its event.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.layers.flashinfer_attention import _INT_WORKSPACE_BYTES, _Staging, paged_kv_metadata
from engine.layers.kv_pool import PAD_PAGE, KVPool

if TYPE_CHECKING:
    from engine.layers.mla_attention import MLAShapes

MLA_DIMS = (512, 64)  # kv_lora_rank, rope dims: the only geometry flashinfer's MLA kernels are tested at
WORKSPACE_BYTES = 128 << 20  # split-KV partial outputs (~17 MB at 132 SMs), flashinfer's recommended size


def flashinfer_mla_supported(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                             latent_dim: int) -> bool:
    """Whether flashinfer's MLA decode may take a rank: CUDA (SM80+), half-precision queries over a
    latent pool of the same dtype, 512 + 64 latent values a token, flashinfer installed. The split
    of the 576 values is checked again on the first run (`FlashInferMLA.run`)."""
    return (
        device.type == "cuda"
        and q_dtype in (torch.bfloat16, torch.float16) and kv_dtype == q_dtype
        and latent_dim == sum(MLA_DIMS)
        and torch.cuda.get_device_capability(device)[0] >= 8
        and importlib.util.find_spec("flashinfer") is not None
    )


def eager_metadata(seq_lens: Sequence[int], table: torch.Tensor, page_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For decode rows of KV lengths seq_lens over the dense CPU page table [b, W] (row i's first
    ceil(seq_lens[i] / page_size) entries): (qo_indptr, kv_indptr (pages), kv_indices, kv_len
    (tokens)), int32 on the CPU, as flashinfer's MLA plan takes them."""
    indptr, indices, _ = paged_kv_metadata(list(seq_lens), table, page_size)
    qo = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return qo, indptr, indices, torch.tensor(list(seq_lens), dtype=torch.int32)


def graph_kv_lens(indptr: torch.Tensor, last: torch.Tensor, page_size: int, out: torch.Tensor) -> torch.Tensor:
    """KV lengths in tokens, into `out` [bs] (CPU int32), of the padded decode metadata the graph
    runner builds (engine/run/cuda_graph.py run_decode: kv_indptr [bs + 1] in pages, last page
    lengths [bs]): (pages - 1) * page_size + last."""
    torch.sub(indptr[1:], indptr[:-1], out=out)
    return out.sub_(1).mul_(page_size).add_(last)


class FlashInferMLA:
    """One rank's flashinfer MLA decode: an eager wrapper planned per step and a CUDA-graph wrapper
    per captured batch size over fixed buffers. `rows` is the row count of the current plan: the
    decode rows MLAPlan.build hands it must be as many (`check_rows`)."""

    def __init__(self, device: torch.device, heads: int, kv: KVPool, q_dtype: torch.dtype, max_batch: int,
                 max_pages_per_req: int) -> None:
        import flashinfer.mla

        self._mla = flashinfer.mla
        self.device, self.heads, self.kv, self.q_dtype = device, heads, kv, q_dtype
        self.page_size, self.max_batch = kv.page_size, max_batch
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # the plan's pinned staging, then (graph plans) the KV lengths [max_batch] int32
        self._staging = _Staging(_INT_WORKSPACE_BYTES + 4 * max_batch)
        self._eager = self._mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="auto")
        # CUDA-graph buffers, shared by every captured size (each wrapper uses a prefix; a replay
        # runs after its own plan's copies, in stream order)
        self._g_qo = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._g_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max(1, max_batch * max_pages_per_req), dtype=torch.int32, device=device)
        self._g_len = torch.ones(max_batch, dtype=torch.int32, device=device)
        self._qo_host = torch.arange(max_batch + 1, dtype=torch.int32).pin_memory()  # never written
        self._graph: dict[int, object] = {}
        self._active: object = self._eager
        self._pending: tuple[torch.Tensor, ...] | None = None
        self.rows = 0
        self.geometry: tuple[int, int, float] | None = None  # kv_lora_rank, rope, scale (first run)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- plans ----

    def eager(self, seq_lens: Sequence[int], table: torch.Tensor) -> FlashInferMLA:
        """This step's decode rows (no graph): seq_lens and their CPU page table [b, W]; planned by
        the step's first run."""
        self._set(self._eager, len(seq_lens), eager_metadata(seq_lens, table, self.page_size))
        return self

    def graph_wrapper(self, bs: int) -> FlashInferMLA:
        """Before capturing size `bs`: its wrapper (made once) with every row padding (one token on
        the padding page), planned by the capture's first warm-up forward."""
        if bs > self.max_batch:
            raise ValueError(f"graph batch {bs} exceeds max_batch {self.max_batch}")
        w = self._graph.get(bs)
        if w is None:
            w = self._mla.BatchMLAPagedAttentionWrapper(
                self.workspace, use_cuda_graph=True, qo_indptr=self._g_qo[: bs + 1],
                kv_indptr=self._g_indptr[: bs + 1], kv_indices=self._g_indices, kv_len_arr=self._g_len[:bs],
                backend="auto",
            )
            self._graph[bs] = w
        pad = torch.full((bs,), PAD_PAGE, dtype=torch.int32, device=self.device)
        self._set(w, bs, (self._qo_host[: bs + 1], torch.arange(bs + 1, dtype=torch.int32), pad,
                          torch.ones(bs, dtype=torch.int32)))
        return self

    def plan_graph(self, bs: int, indptr: torch.Tensor, last: torch.Tensor, indices: torch.Tensor) -> FlashInferMLA:
        """Before replaying size `bs`: plan its wrapper from the runner's padded metadata (indptr
        [bs + 1] and last page lengths [bs] in pinned host memory, indices on the device)."""
        if self.geometry is None:
            raise RuntimeError("a flashinfer MLA graph is replayed before any forward ran (no geometry)")
        w = self._graph[bs]
        buf = self._staging.take()
        kv_len = graph_kv_lens(indptr, last, self.page_size, buf[_INT_WORKSPACE_BYTES:].view(torch.int32)[:bs])
        self._plan(w, (self._qo_host[: bs + 1], indptr, indices, kv_len), buf)
        self._active, self._pending, self.rows = w, None, bs
        return self

    def _set(self, w: object, rows: int, meta: tuple[torch.Tensor, ...]) -> None:
        self._active, self._pending, self.rows = w, meta, rows

    def _plan(self, w, meta: tuple[torch.Tensor, ...], buf: torch.Tensor) -> None:  # noqa: ANN001
        """wrapper.plan over the taken staging buffer `buf`, released right after (its event)."""
        r, p, scale = self.geometry  # type: ignore[misc]
        w._pin_memory_int_workspace_buffer = buf[:_INT_WORKSPACE_BYTES]
        w.plan(*meta, self.heads, r, p, self.page_size, False, scale, self.q_dtype, self.kv.dtype)
        self._staging.release()

    def check_rows(self, rows: int) -> None:
        """A plan for another step's rows must never be read (a forward without `prepare`)."""
        if rows != self.rows:
            raise RuntimeError(f"flashinfer MLA planned for {self.rows} decode rows, the step has {rows}")

    # ---- per layer ----

    def run(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: KVPool, layer: int, s: MLAShapes) -> torch.Tensor:
        """o_lat [b, H, kv_lora_rank] of the absorbed queries q_lat [b, H, kv_lora_rank] and roped
        q_pe [b, H, rope] over `layer`'s latents (q's dtype)."""
        if (s.kv_lora_rank, s.rope, s.scale) != self.geometry:
            self._learn(s, kv)
        if self._pending is not None:
            if torch.cuda.is_current_stream_capturing():  # a plan copies from the host: not capturable
                raise RuntimeError("flashinfer MLA: a CUDA graph captured before its warm-up forward planned it")
            meta, self._pending = self._pending, None
            self._plan(self._active, meta, self._staging.take())
        ckv, kpe = self._caches[layer]
        if q_pe.stride(-1) != 1:
            q_pe = q_pe.contiguous()
        return self._active.run(q_lat, q_pe, ckv, kpe)  # type: ignore[attr-defined]

    def _learn(self, s: MLAShapes, kv: KVPool) -> None:
        """The model's geometry, once (the first run): refused where flashinfer's kernels do not
        apply or where it changes (another model on this pool)."""
        if self.geometry is not None:
            raise ValueError(f"flashinfer MLA planned for (kv_lora_rank, rope, scale) {self.geometry}, "
                             f"a layer asks {(s.kv_lora_rank, s.rope, s.scale)}")
        if (s.kv_lora_rank, s.rope) != MLA_DIMS or s.heads != self.heads or kv is not self.kv:
            raise ValueError(f"flashinfer's MLA decode takes kv_lora_rank {MLA_DIMS[0]} + rope {MLA_DIMS[1]} "
                             f"and {self.heads} heads over the bound pool, got {s.kv_lora_rank} + {s.rope}, "
                             f"{s.heads} heads (the tuning's mla_flashinfer_min_heads 0 keeps the triton kernel)")
        self.geometry = (s.kv_lora_rank, s.rope, s.scale)
        r, ps = s.kv_lora_rank, self.page_size
        views = (lat.view(kv.num_pages, ps, lat.shape[-1]) for lat in kv.latent)
        self._caches = [(v[..., :r], v[..., r:]) for v in views]
