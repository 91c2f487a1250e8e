"""Fused elementwise kernels for the decoder, with exact torch fallbacks.

On a CUDA device with fp16/bf16 tensors and flashinfer installed, these call flashinfer's
fused kernels (RMSNorm, add+RMSNorm, SiLU-and-mul, in-place rotary from a cos/sin cache). On
a CPU, float32 or bf16, they call our C kernels (engine/layers/cpu_kernels.py: each row read
and written once, its bits its own). Everywhere else, and where the C kernels do not build,
the plain torch code runs.

flashinfer is imported lazily, on the first CUDA half-precision call: CPU installs never
import it. `set_fused(False)` turns the fused path off (for A/B comparisons).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels, triton_ops
from engine.layers.context import RopeState
from engine.layers.tuning import kernel_tuning

_HALF = (torch.float16, torch.bfloat16)
_enabled = True
_fi: ModuleType | None | bool = False  # False: not tried yet; None: unavailable


def set_fused(enabled: bool) -> None:
    """Enable or disable the flashinfer kernels (the torch fallbacks are always available)."""
    global _enabled
    _enabled = enabled


def fused_enabled() -> bool:
    """Whether fused kernels are on (set_fused); the triton GEMV/prologue honour it too."""
    return _enabled


def flashinfer_module() -> ModuleType | None:
    """The flashinfer package, or None when it cannot be imported (imported once)."""
    global _fi
    if _fi is False:
        # the CUDA-JIT norm kernels: one known module to compile (the CuTe-DSL variants need
        # nvidia-cutlass-dsl and compile per shape); set, not defaulted: a kernel choice is ours
        # (configs/tuning), not a user's environment's
        os.environ["FLASHINFER_USE_CUDA_NORM"] = "1"
        try:
            import flashinfer
            import flashinfer.activation  # noqa: F401
            import flashinfer.norm  # noqa: F401
            import flashinfer.rope  # noqa: F401

            _fi = flashinfer
        except Exception:  # noqa: BLE001 - any import failure means "use torch"
            _fi = None
    return _fi  # type: ignore[return-value]


def fused_ok(x: torch.Tensor) -> bool:
    """Whether x takes the flashinfer path: CUDA, fp16/bf16, flashinfer importable, enabled."""
    return _enabled and x.is_cuda and x.dtype in _HALF and flashinfer_module() is not None


# ---------------------------------------------------------------- RMSNorm


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back before the weight (as HF Llama does)."""
    if x.dtype in _HALF and x.device.type == "cpu":  # the same values, two float32 temporaries fewer
        h = x.float()
        h = h.mul_(torch.rsqrt(torch.mean(h * h, -1, keepdim=True).add_(eps)))
        return weight * h.to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([T, H] or [T, heads, D]); returns a new tensor."""
    if fused_ok(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
        return flashinfer_module().norm.rmsnorm(x, weight, eps)
    if cpu_kernels.norm_ok(x, weight):
        return cpu_kernels.add_rms_norm(x, None, weight, eps)[0]
    return _rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual).

    The fused kernel works in place: `x` receives the normalized values and `residual` the
    sum, so both must be tensors the caller owns (fresh activations).
    """
    if fused_ok(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
        flashinfer_module().norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    if x.dim() == 2 and residual.dtype == x.dtype and residual.stride(-1) == 1 and cpu_kernels.norm_ok(x, weight):
        return cpu_kernels.add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return _rms_norm_torch(total, weight, eps), total


# ---------------------------------------------------------------- SiLU and mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d] (the SwiGLU gate)."""
    if fused_ok(x) and x.is_contiguous() and (x.shape[-1] * x.element_size()) % 16 == 0:
        return flashinfer_module().activation.silu_and_mul(x)
    if x.dim() == 2 and cpu_kernels.elementwise_ok(x):
        return cpu_kernels.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if x.device.type == "cpu" and x.dtype in _HALF:
        return F.silu(gate).mul_(up)  # in place: the same values, one allocation fewer
    return F.silu(gate) * up


# ---------------------------------------------------------------- rotary


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, head_dim] in `dtype`, computed in float32 (rotate-half layout), times `factor`
    (YaRN's attention factor; 1 otherwise)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rope with the sign of rotate_half moved into sin_signed = [-sin | sin] (made once a
    forward) and x * cos + swapped * sin_signed as one addcmul: 3 passes over x instead of 5.
    In half precision the sum is rounded once instead of twice (not bitwise apply_rope)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos[:, None, :], swapped, sin_signed[:, None, :])


def _cpu_rope_ok(x: torch.Tensor, cos: torch.Tensor, head_dim: int) -> bool:
    """Whether the C rotary takes x [T, H, D] in place: its heads adjacent in each row (strides
    only, never contiguity, which can depend on T), cos of its dtype."""
    return (x.shape[-1] == head_dim and cpu_kernels.heads_packed(x) and cos.dtype == x.dtype and cos.is_contiguous()
            and cpu_kernels.elementwise_ok(x))


class Rotary:
    """Neox-style (rotate_half) rotary embedding for Llama/Qwen.

    `prepare(positions, dtype)` runs once per forward; `apply(q, k, state)` once per layer.
    The fused path keeps a float32 [max_positions, head_dim] cache (cos | sin halves, the
    layout flashinfer's apply_rope_with_cos_sin_cache_inplace reads), built once per device,
    and rotates q and k in place. The torch path computes cos/sin per forward, as HF does.
    """

    def __init__(self, inv_freq: torch.Tensor, head_dim: int, max_positions: int, factor: float = 1.0) -> None:
        self.inv_freq = inv_freq  # float32 [head_dim/2]
        self.factor = factor  # cos and sin scaled by it (YaRN's attention factor; else 1)
        self.head_dim = head_dim
        self.max_positions = max_positions
        self._cache: torch.Tensor | None = None
        self._signed: tuple[torch.Tensor, torch.Tensor] | None = None  # (sin, [-sin | sin]) of the last forward

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:  # once, after the first move to a device
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cache is None or self._cache.device != device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self._inv_freq_on(device)[None, :]
            self._cache = (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.factor).contiguous()
        return self._cache

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeState:
        """Per-forward state for `apply` (and the fused prologue, where the GPU's tuning turns
        it on: engine/layers/tuning.py)."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        if fused_ok(probe):
            prologue = kernel_tuning(probe.device).fused_prologue and triton_ops.supported(self.head_dim, probe)
            return RopeState(True, positions, cos_sin_cache=self.cos_sin_cache(positions.device), prologue=prologue)
        cos, sin = rope_cos_sin(positions, self._inv_freq_on(positions.device), dtype, self.factor)
        return RopeState(False, positions, cos=cos, sin=sin)

    def apply(self, q: torch.Tensor, k: torch.Tensor, state: RopeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D]; the fused path and the CPU's C kernel work in
        place (last dim contiguous views are fine) and return the same tensors."""
        if state.fused and q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype in _HALF:
            t = q.shape[0]
            flashinfer_module().rope.apply_rope_with_cos_sin_cache_inplace(
                state.positions, q.view(t, -1), k.view(t, -1), self.head_dim, state.cos_sin_cache, is_neox=True
            )
            return q, k
        if state.fused:  # a layout the kernel cannot take: exact torch math instead
            cos, sin = rope_cos_sin(state.positions, self._inv_freq_on(state.positions.device), q.dtype,
                                    self.factor)
        else:
            cos, sin = state.cos, state.sin
            if all(_cpu_rope_ok(x, cos, self.head_dim) for x in (q, k)):  # in place (Qwen3: fresh q/k-norm outputs)
                cpu_kernels.rope_(q, q.shape[1], self.head_dim, cos, sin)
                cpu_kernels.rope_(k, k.shape[1], self.head_dim, cos, sin)
                return q, k
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def apply_qkv(
        self, qkv: torch.Tensor, num_q: int, num_kv: int, state: RopeState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU torch path (no q/k norm): q and k of the fused QKV projection [T, (Hq + 2 Hkv) D],
        rotated together. Returns q [T, Hq, D], k [T, Hkv, D]: views of qkv, rotated in place by
        the C kernel (float32, bf16), else new tensors (fp16: apply_rope_signed, one addcmul;
        float32 without the kernel: apply_rope)."""
        assert not state.fused and state.cos is not None and state.sin is not None
        t, d = qkv.shape[0], self.head_dim
        if cpu_kernels.elementwise_ok(qkv) and state.cos.dtype == qkv.dtype and state.cos.is_contiguous():
            cpu_kernels.rope_(qkv, num_q + num_kv, d, state.cos, state.sin)
            qk = qkv[:, : (num_q + num_kv) * d].view(t, num_q + num_kv, d)
        elif qkv.dtype in _HALF:
            if self._signed is None or self._signed[0] is not state.sin:  # once a forward
                half = self.head_dim // 2
                self._signed = (state.sin, torch.cat((-state.sin[:, :half], state.sin[:, half:]), dim=-1))
            qk = apply_rope_signed(qkv[:, : (num_q + num_kv) * d].view(t, num_q + num_kv, d), state.cos,
                                   self._signed[1])
        else:
            qk = apply_rope(qkv[:, : (num_q + num_kv) * d].view(t, num_q + num_kv, d), state.cos, state.sin)
        return qk[:, :num_q], qk[:, num_q:]
