"""The sampler's noise: splitmix64 of (seed, position, token id) on int64 tensors, and its host twin.

A row's noise is a pure function of its request's seed, the position and the token id, so a
seeded request draws the same tokens whatever its batch (engine/run/sampler.py; on CUDA one triton
launch does the same arithmetic: triton_ops.race_noise_).
"""

from __future__ import annotations

from torch import Tensor


def _s64(x: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the signed int64 torch stores."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1)


def _lshr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64: torch's >> is arithmetic, so clear the sign-extended bits."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps like uint64); z is not modified."""
    z = z ^ _lshr(z, 30)  # the one allocation; the rest is in place to spare [B, V] temporaries
    z.mul_(_MIX1)
    z ^= _lshr(z, 27)
    z.mul_(_MIX2)
    z ^= _lshr(z, 31)
    return z


def _mix64_int(x: int) -> int:
    """Host twin of _mix64 (for per-request precomputation and tests); int64 in, int64 out."""
    mask = (1 << 64) - 1
    z = x & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return _s64(z ^ (z >> 31))
