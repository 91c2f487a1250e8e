"""KVLayout and the pool over any declared layout: validation, bytes, the GQA pool's names and
sizes, per-component store/gather round trips (also 8-bit and a component of its own dtype), and
the host tier's one-size rule."""

from __future__ import annotations

import pytest
import torch

from engine.layers.kv_layout import KVComponent, KVLayout
from engine.layers.kv_pool import KVPool
from engine.run.host_tier import HostCopies


def test_layout_validation_and_bytes() -> None:
    with pytest.raises(ValueError, match="at least one component"):
        KVLayout(())
    with pytest.raises(ValueError, match="repeat"):
        KVLayout((KVComponent("k", 1, 8), KVComponent("k", 1, 8)))
    with pytest.raises(ValueError, match="identifier"):
        KVComponent("k v", 1, 8)
    with pytest.raises(ValueError, match="'latent'.*>= 1"):
        KVComponent("latent", 1, 0)
    gqa = KVLayout.gqa(8, 128)
    assert gqa.is_gqa and gqa.names == ("k", "v") and gqa.token_bytes(torch.bfloat16) == 2 * 8 * 128 * 2
    assert gqa.bytes_per_token(32, torch.float8_e4m3fn) == 32 * 2 * 8 * 128
    assert gqa.describe(torch.bfloat16) == "k:8x128:bfloat16,v:8x128:bfloat16" and gqa.describe() == "k:8x128,v:8x128"
    mla = KVLayout.latent(512, 64)
    assert not mla.is_gqa and mla.token_bytes(torch.bfloat16) == 1152
    assert mla.uniform_page_bytes(16, torch.bfloat16) == 16 * 1152
    mixed = KVLayout((KVComponent("latent", 1, 512, torch.float8_e4m3fn), KVComponent("rope", 1, 64)))
    assert mixed.token_bytes(torch.bfloat16) == 512 + 128
    with pytest.raises(ValueError, match="one size per token.*latent:1x512:float8_e4m3fn,rope:1x64:bfloat16"):
        mixed.uniform_page_bytes(16, torch.bfloat16)


def test_gqa_pool_is_the_k_v_pool() -> None:
    """The GQA constructor and from_layout(gqa) give the same tensors: names, shapes, bytes."""
    a = KVPool(3, 5, 4, 2, 8, torch.bfloat16, "cpu")
    b = KVPool.from_layout(KVLayout.gqa(2, 8), 3, 5, 4, torch.bfloat16, "cpu")
    for p in (a, b):
        assert p.k_all.shape == p.v_all.shape == (3, 20, 2, 8) and len(p.k) == len(p.v) == 3
        assert p.k[1].data_ptr() == p.k_all[1].data_ptr() and (p.num_kv_heads, p.head_dim) == (2, 8)
        assert p.nbytes() == KVPool.bytes_per_page(3, 4, 2, 8, torch.bfloat16) * 5 == 2 * 3 * 20 * 2 * 8 * 2
        assert [t.shape for t in p.page_bytes()] == [(3, 5, 4 * 2 * 8 * 2)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_components_round_trip(dtype: torch.dtype) -> None:
    """Two components of different widths, one in its own dtype: each stored at its slots and
    gathered back by page, per layer, through the pool's byte views where 8-bit."""
    layout = KVLayout((KVComponent("latent", 1, 12), KVComponent("scale", 2, 3, torch.float32)))
    pool = KVPool.from_layout(layout, 2, 6, 4, dtype, "cpu")
    assert pool.all["latent"].dtype == dtype and pool.all["scale"].dtype == torch.float32
    assert pool.latent[1].shape == (24, 1, 12)
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(8, 1, 12, generator=g).to(dtype).float()  # values the dtype holds exactly
    sc = torch.randn(8, 2, 3, generator=g)
    slots = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])  # pages 1 and 3
    pool.store(1, slots, lat, sc)
    got_lat, got_sc = pool.gather_pages(1, torch.tensor([[3, 1]]), torch.float32)
    assert got_lat.shape == (1, 8, 1, 12) and got_sc.shape == (1, 8, 2, 3)
    assert torch.equal(got_lat[0], torch.cat([lat[4:], lat[:4]]))
    assert torch.equal(got_sc[0], torch.cat([sc[4:], sc[:4]]))
    assert not pool.all["latent"][0].float().any()  # layer 0 untouched
    views = pool.page_view(1)
    assert views[0].shape == (6, 4, 1, 12) and views[1].shape == (6, 4, 2, 3)


def test_host_tier_needs_components_of_one_size() -> None:
    mixed = KVLayout((KVComponent("latent", 1, 12), KVComponent("scale", 2, 3)))
    pool = KVPool.from_layout(mixed, 2, 6, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one size per token"):
        HostCopies(pool, "/dev/shm/unused")
    latent = KVPool.from_layout(KVLayout.latent(8, 4), 3, 6, 4, torch.bfloat16, "cpu")
    copies = HostCopies(latent, "/dev/shm/unused")
    assert copies.page_bytes == 3 * 4 * 12 * 2 and copies.components == 1


def test_cpu_pool_is_zero_and_resident_only_where_written() -> None:
    """A CPU pool is fresh anonymous memory (kv_pool.zeros): all zeros, writable, and its pages
    cost no resident memory until written (torch.zeros wrote every byte at start)."""
    import resource

    from engine.layers import kv_pool

    def rss_kib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024

    before = rss_kib()
    t = kv_pool.zeros((4, 1 << 16, 8, 128), torch.float32, torch.device("cpu"))  # 1 GiB
    assert rss_kib() - before < 64 << 10  # < 64 MiB resident of 1 GiB
    assert t.shape == (4, 1 << 16, 8, 128) and t.dtype == torch.float32
    assert not t[0, :1000].any() and not t[3, -1000:].any()
    t[2, 5] = 1.5
    assert t[2, 5].eq(1.5).all() and t.sum().item() == 1.5 * 8 * 128
