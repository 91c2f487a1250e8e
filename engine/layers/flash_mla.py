"""FlashMLA's dense decode (DeepSeek's SM90 kernel, PyPI `sgl-flash-mla`, its `use_legacy` half)
over our latent pool: the decode rows of an MLA rank where the GPU's tuning takes it
(KernelTuning.mla_flashmla) and its conditions hold (`flashmla_supported`).

Why: on an H200 (bin/bench mla --flashmla, bench/results/mla-flashmla-h200-d27660d.json) it ran
DeepSeek-V3's decode attention at 128 heads, batch 64, context 4096 in 128 us a layer (60% of the
copy bandwidth; flashinfer's MLA wrapper 141 us, our triton kernel 462 us), and at 16 heads (V3 at
tp 8) at 91-103% of the copy bandwidth from batch 64 (ours: 67-84%).

Its contract is our triton kernel's: the step's int32 page table [b, W] and KV lengths [b] on the
device, read in place (MLABackend's dense-table protocol for CUDA graphs), queries [b, 1, H, 576]
(q_lat | q_pe), the pool viewed as [pages, 64, 1, 576]: it takes 64-token pages only
(ServerConfig's page size: 64 for MLA models on CUDA). Its split schedule (`schedule`: tile
metadata and split counts) is made on the device from the lengths, once per step, by the plan
(engine/layers/mla_attention.py MLAPlan.build), so a CUDA graph captures it with the layers.
The schedule balances the whole batch over the SMs, so a row's sums depend on the batch:
deterministic inference keeps our kernel.
"""

from __future__ import annotations

import importlib.util

import torch

PAGE = 64  # the only page size its kernels take
LATENT = (512, 64)  # kv_lora_rank, rope: the geometry its kernels are built for (head_dim_v 512)


def flashmla_supported(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, latent_dim: int,
                       page_size: int) -> bool:
    """Whether FlashMLA may take a rank's decode rows: an SM90 GPU, bf16 queries over a bf16
    latent pool of 512 + 64 values a token in 64-token pages, the package installed."""
    return (
        device.type == "cuda"
        and q_dtype == torch.bfloat16 and kv_dtype == torch.bfloat16
        and latent_dim == sum(LATENT) and page_size == PAGE
        and torch.cuda.get_device_capability(device) == (9, 0)
        and importlib.util.find_spec("flash_mla") is not None
    )


class FlashMLA:
    """One rank's FlashMLA decode: `schedule` once a step, `run` once a layer."""

    def __init__(self, heads: int) -> None:
        import flash_mla

        self._fm, self.heads = flash_mla, heads

    def schedule(self, lens: torch.Tensor) -> object:
        """The split schedule of decode rows of KV lengths `lens` (int32 [b], device): one kernel,
        no host sync (capturable)."""
        meta, _ = self._fm.get_mla_metadata()
        meta.tile_scheduler_metadata, meta.num_splits = self._fm.get_mla_decoding_metadata(
            lens, self.heads, 1, use_legacy=True)
        return meta

    def run(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, meta: object, scale: float) -> torch.Tensor:
        """o_lat [b, H, 512] of q_lat [b, H, 512] and roped q_pe [b, H, 64] over one layer's
        latents [slots, 1, 576] through `table` [b, W] and `lens` [b] (int32, device)."""
        q = torch.cat([q_lat, q_pe], -1).unsqueeze(1)
        k = latent.view(-1, PAGE, 1, latent.shape[-1])
        out, _ = self._fm.flash_mla_with_kvcache(q, k, table, lens, LATENT[0], meta, softmax_scale=scale,
                                                 causal=False, use_legacy=True)
        return out.squeeze(1)
