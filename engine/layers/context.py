"""The forward context: what every layer of one model forward reads.

Built once per forward by the model (`ForwardContext`), passed down instead of positional
argument lists; the RoPE state is typed (`RopeState`) instead of a tuple protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.layers.attention import AttentionBackend
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from engine.layers.ops import Rotary


@dataclass(frozen=True)
class RopeState:
    """Per-forward rotary state. Fused path: positions + the float32 cos|sin cache the
    kernels read (`prologue`: layers may use the one-kernel q/k-norm + RoPE + KV-store);
    torch path: cos and sin per token."""

    fused: bool
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor | None = None
    prologue: bool = False
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardContext:
    batch: ForwardBatch
    kv: KVPool
    backend: AttentionBackend
    rotary: Rotary
    rope: RopeState
