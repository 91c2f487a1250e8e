"""How tensor parallelism splits heads and ranges (pure Python, no torch: the supervisor checks
--tp-size against a model's heads with `head_shard` before any process starts, engine/config.py)."""

from __future__ import annotations

from dataclasses import dataclass


def range_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of [0, n) cut into `parts` contiguous ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q: tuple[int, int]  # this rank's q head range
    kv: tuple[int, int]  # its K/V head range (a replica when K/V heads are fewer than ranks)

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:  # split K/V heads (unevenly if need be); q heads follow their group
        ks, ke = range_split(num_kv_heads, world, rank)
        return HeadShard((ks * group, ke * group), (ks, ke))
    # fewer K/V heads than ranks: each rank's q heads must read one K/V head, which it replicates
    if num_heads % world or world % num_kv_heads:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs num_heads ({num_heads}) divisible by it and it divisible "
            f"by num_kv_heads ({num_kv_heads}) when there are fewer K/V heads than ranks"
        )
    qs, qe = range_split(num_heads, world, rank)
    return HeadShard((qs, qe), (qs // group, qs // group + 1))
