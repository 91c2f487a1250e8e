"""Sort-free top_k / top_p masks on the GPU: flashinfer's radix kernels (`top_k_mask_logits`,
`top_p_renorm_probs`, as SGLang's sampler uses them), for the sampler's "sort" mode when
deterministic inference is off (engine/run/sampler.py `Sampler._race_masked`).

Why: a batch with a top_p row and no top_k (Llama's generation_config: top_p 0.9) sorted the
whole vocabulary each step. On an H100, 64 rows x 128k: the sampler 1.5 ms eager, the served
decode step 9.78 -> 11.17 ms (docs/PERF.md, thirty-fifth session). The masks keep what the sort's
cumulative mass keeps, up to float rounding at the boundary and ties there (kept whole), which only
deterministic inference promises anything about: it keeps the sort.
"""

from __future__ import annotations

import math

import torch

from engine.layers import ops


def available(device: torch.device) -> bool:
    """Whether the masks run here: a CUDA device and flashinfer's sampling module importable."""
    if device.type != "cuda" or ops.flashinfer_module() is None:
        return False
    try:
        import flashinfer.sampling  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "sort"
        return False
    return True


def top_k_mask(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """z [B, V] float32 with all but each row's top_k[b] largest at -inf (top_k >= V: the row as
    is; ties at the k-th value kept)."""
    import flashinfer.sampling

    vocab = z.shape[1]
    # the kernel asks 0 < k < V: a row without top_k (k = V) is masked at V - 1 and then not used
    masked = flashinfer.sampling.top_k_mask_logits(z, top_k.clamp(1, vocab - 1).to(torch.int32))
    return torch.where((top_k < vocab).unsqueeze(1), masked, z)


def top_p_mask(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """z [B, V] float32 (temperature applied) with what lies outside each row's top_p nucleus of
    softmax(z) at -inf (top_p >= 1: the row as is)."""
    import flashinfer.sampling

    # integer histograms: the nucleus' edge the same every run (float atomics would move it)
    kept = flashinfer.sampling.top_p_renorm_probs(torch.softmax(z, dim=-1), top_p.float(), is_deterministic=True) > 0
    return z.masked_fill(~kept & (top_p < 1.0).unsqueeze(1), -math.inf)


def warm(device: torch.device, vocab: int) -> None:
    """Build / load flashinfer's sampling module now (its JIT compiles at first use), at the model's
    vocabulary (its kernels differ with the row's length): before ready."""
    z = torch.randn(2, vocab, device=device)
    top_p_mask(top_k_mask(z, torch.tensor([3, vocab], device=device)), torch.tensor([0.5, 1.0], device=device))
    torch.cuda.synchronize(device)
