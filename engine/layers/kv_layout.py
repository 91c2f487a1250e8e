"""KVLayout: what a model caches per token and layer, declared by the model plug-in.

A layout is a tuple of components, each `heads x dim` values per token and layer:

* GQA (Llama family): `k` and `v`, each num_kv_heads x head_dim (this rank's heads);
* MLA (DeepSeek-V2/V3, Kimi-K2): one `latent` of 1 x (kv_lora_rank + qk_rope_head_dim), the
  compressed KV and the shared rope key (576 values for V3: 1152 bytes a token and layer in bf16).

The KV pool allocates one [layers, slots, heads, dim] tensor per component; memory sizing,
the host tier (L2), the L3 file layout and its fingerprint all read the layout instead of
assuming K and V. A component's dtype is None when it is stored in the pool's KV dtype (the
model's, or --kv-cache-dtype's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVComponent:
    name: str
    heads: int
    dim: int
    dtype: torch.dtype | None = None  # None: the pool's KV dtype

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"KV component name must be an identifier, got {self.name!r}")
        if self.heads < 1 or self.dim < 1:
            raise ValueError(f"KV component {self.name!r}: heads and dim must be >= 1, got {self.heads} x {self.dim}")

    @property
    def width(self) -> int:
        """Values per token and layer."""
        return self.heads * self.dim

    def dtype_in(self, kv_dtype: torch.dtype) -> torch.dtype:
        return self.dtype or kv_dtype

    def token_bytes(self, kv_dtype: torch.dtype) -> int:
        return self.width * self.dtype_in(kv_dtype).itemsize


@dataclass(frozen=True)
class KVLayout:
    components: tuple[KVComponent, ...]

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("a KV layout needs at least one component")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"KV layout component names repeat: {names}")

    @classmethod
    def gqa(cls, num_kv_heads: int, head_dim: int) -> KVLayout:
        """K and V per KV head (the Llama family)."""
        return cls((KVComponent("k", num_kv_heads, head_dim), KVComponent("v", num_kv_heads, head_dim)))

    @classmethod
    def latent(cls, kv_lora_rank: int, rope_dim: int) -> KVLayout:
        """MLA: one latent of kv_lora_rank compressed values then rope_dim rope-key values."""
        return cls((KVComponent("latent", 1, kv_lora_rank + rope_dim),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    @property
    def is_gqa(self) -> bool:
        return self.names == ("k", "v")

    def token_bytes(self, kv_dtype: torch.dtype) -> int:
        """Bytes one token costs in one layer, all components."""
        return sum(c.token_bytes(kv_dtype) for c in self.components)

    def bytes_per_token(self, num_layers: int, kv_dtype: torch.dtype) -> int:
        return num_layers * self.token_bytes(kv_dtype)

    def uniform_page_bytes(self, page_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one page of one component in one layer, when every component has that size
        (the host slab's rows are [layer][component]; engine/run/host_tier.py). ValueError when
        the components differ in size."""
        sizes = {c.token_bytes(kv_dtype) for c in self.components}
        if len(sizes) != 1:
            raise ValueError(f"the host tier needs KV components of one size per token, got {self.describe(kv_dtype)}")
        return page_size * sizes.pop()

    def describe(self, kv_dtype: torch.dtype | None = None) -> str:
        """e.g. 'k:8x128,v:8x128' or 'latent:1x576' (with dtypes when kv_dtype is given):
        the layout's part of the L3 fingerprint and of the start-up log."""
        def one(c: KVComponent) -> str:
            dt = "" if kv_dtype is None else f":{str(c.dtype_in(kv_dtype)).removeprefix('torch.')}"
            return f"{c.name}:{c.heads}x{c.dim}{dt}"

        return ",".join(one(c) for c in self.components)
