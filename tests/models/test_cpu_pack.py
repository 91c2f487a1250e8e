"""CPU bf16 projections on oneDNN-packed weights (engine/layers/parallel.py: pack_for_cpu):
the same products as the plain weight, for decode-sized and prefill-sized inputs, and only
where it applies (bf16, no bias)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.parallel import Linear, onednn_packs_bf16, pack_for_cpu


def _linear(dtype: torch.dtype, bias: bool = False) -> Linear:
    torch.manual_seed(0)
    m = Linear(576, 1536, bias, dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(1536, 576) * 0.05)
        if bias:
            m.bias.copy_(torch.randn(1536))
    return m


needs_avx512 = pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN packs bf16 with AVX512 or AVX-NE-CONVERT")


@needs_avx512
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_packed_product_equals_the_plain_one(rows: int) -> None:
    m = _linear(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    with torch.inference_mode():
        plain = m(x)
        assert pack_for_cpu(m) == 1
        packed = m(x)
    assert packed.dtype == torch.bfloat16 and packed.shape == (rows, 1536)
    ref = x.float() @ m.weight.float().T
    # both round an fp32 accumulation to bf16 once: at most one bf16 ulp apart, and as close to fp32
    torch.testing.assert_close(packed, plain, rtol=2 ** -7, atol=1e-2)
    assert (packed.float() - ref).abs().max() <= (plain.float() - ref).abs().max() * 1.5 + 1e-3


def test_only_bf16_without_bias_is_packed() -> None:
    assert pack_for_cpu(_linear(torch.float32)) == 0
    assert pack_for_cpu(_linear(torch.bfloat16, bias=True)) == 0


@pytest.mark.skipif(onednn_packs_bf16(), reason="this CPU packs bf16 weights")
def test_a_cpu_without_bf16_packing_keeps_the_plain_weight() -> None:
    m = _linear(torch.bfloat16)
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.inference_mode():
        plain = m(x)
        assert pack_for_cpu(m) == 0
        assert torch.equal(m(x), plain)
