"""CPU projections and LM heads on oneDNN-packed weights (engine/layers/cpu_gemm.py: cpu_pack;
engine/layers/parallel.py: pack_for_cpu): the same products as the plain weight, for decode-sized and prefill-sized
inputs, in float32 and bf16, and only where they apply (no bias; bf16 only where the CPU can)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine.layers import cpu_gemm
from engine.layers.cpu_gemm import onednn_packs
from engine.layers.parallel import (
    Linear,
    ParallelLMHead,
    VocabParallelEmbedding,
    lm_logits,
    pack_for_cpu,
)


def _linear(dtype: torch.dtype, bias: bool = False) -> Linear:
    torch.manual_seed(0)
    m = Linear(576, 1536, bias, dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(1536, 576) * 0.05)
        if bias:
            m.bias.copy_(torch.randn(1536))
    return m


def _packs(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not onednn_packs(dtype), reason=f"oneDNN cannot pack {dtype} on this CPU")


# one fp32 accumulation rounded once: bf16 at most an ulp from the plain product; fp32 a few ulps
_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-2}}


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=_packs(torch.float32)),
                                   pytest.param(torch.bfloat16, marks=_packs(torch.bfloat16))])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_packed_product_equals_the_plain_one(rows: int, dtype: torch.dtype) -> None:
    m = _linear(dtype)
    x = torch.randn(rows, 576).to(dtype)
    w = m.weight.detach().clone()
    with torch.inference_mode():
        plain = m(x)
        assert pack_for_cpu(m) == 1
        packed = m(x)
    assert packed.dtype == dtype and packed.shape == (rows, 1536)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(packed, plain, **_TOL[dtype])
    err = (packed.double() - ref).abs()
    if dtype == torch.float32:  # the textbook bound of a float32 dot product of length K: K u |x| |w|
        u = 2.0 ** -24
        assert (err <= 576 * u * (x.double().abs() @ w.double().abs().T) + u * ref.abs()).all()
    else:  # rounded to bf16 once, as the plain product
        assert err.max() <= (plain.double() - ref).abs().max() * 1.5 + 1e-6


@_packs(torch.float32)
def test_the_lm_head_is_packed_and_gives_the_same_logits() -> None:
    torch.manual_seed(0)
    head = ParallelLMHead(576, 1000, torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 576))
    h = torch.randn(5, 576)
    with torch.inference_mode():
        plain = lm_logits(h, head.weight, 1000)
        assert pack_for_cpu(head) == 1 and head.packed is not None
        packed = lm_logits(h, head.weight, 1000, head.packed)
    assert head.weight.is_meta  # the plain copy is dropped
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


@_packs(torch.float32)
def test_the_embedding_is_packed_only_when_it_is_the_lm_head() -> None:
    untied = nn.ModuleList([VocabParallelEmbedding(100, 16, torch.float32), ParallelLMHead(16, 100, torch.float32)])
    assert pack_for_cpu(untied) == 1 and untied[0].packed is None and untied[1].packed is not None
    tied = nn.ModuleList([VocabParallelEmbedding(100, 16, torch.float32), Linear(16, 32, False, torch.float32)])
    assert pack_for_cpu(tied) == 2 and tied[0].packed is not None


@_packs(torch.float32)
def test_a_packed_projection_keeps_one_copy_of_its_weight() -> None:
    m = _linear(torch.float32)
    with torch.inference_mode():
        pack_for_cpu(m)
        out = m.forward_silu_mul(torch.randn(3, 2 * 576))  # silu(gate) * up, then the packed product
    assert m.weight.is_meta and m.weight.shape == (1536, 576) and m.weight.nbytes == 1536 * 576 * 4
    assert out.shape == (3, 1536) and torch.isfinite(out).all()
    emb = VocabParallelEmbedding(100, 16, torch.float32)
    with torch.no_grad():
        emb.weight.normal_()
    assert pack_for_cpu(emb) == 1 and not emb.weight.is_meta  # the lookup still reads it
    assert torch.equal(emb(torch.tensor([3])), emb.weight[3:4])


def test_only_bias_free_weights_are_packed() -> None:
    assert pack_for_cpu(_linear(torch.float32, bias=True)) == 0
    assert pack_for_cpu(_linear(torch.bfloat16, bias=True)) == 0


@pytest.mark.skipif(onednn_packs(torch.bfloat16), reason="this CPU packs bf16 weights")
def test_a_cpu_without_bf16_packing_keeps_the_plain_weight() -> None:
    m = _linear(torch.bfloat16)
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.inference_mode():
        plain = m(x)
        assert pack_for_cpu(m) == 0
        assert torch.equal(m(x), plain)


@pytest.fixture
def two_threads() -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    cpu_gemm._one_thread_rows.clear()
    yield
    torch.set_num_threads(was)
    cpu_gemm._one_thread_rows.clear()


@_packs(torch.float32)
def test_one_thread_products_have_all_threads_bits(two_threads: None) -> None:
    """Whatever the measurement picks on this machine, a product's bits are all threads' at every
    row count (the rule checks them before it takes one thread)."""
    for n, k in ((960, 576), (3072, 576)):
        w = cpu_gemm.cpu_pack(torch.randn(n, k))
        for rows in (1, 7, 16, 100, 300):
            x = torch.randn(rows, k)
            assert torch.equal(cpu_gemm.packed_linear(x, w), cpu_gemm._gemm(x, w))
        assert cpu_gemm._one_thread_rows[(n, k, torch.float32, 2)] in (0, *cpu_gemm.ROW_STEPS)


@_packs(torch.float32)
def test_one_thread_only_where_faster_and_bit_equal(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    w = cpu_gemm.cpu_pack(torch.randn(64, 32))
    one_s = {"s": 1.0}
    monkeypatch.setattr(cpu_gemm, "_seconds", lambda one, all_: (one_s["s"], 2.0))
    assert cpu_gemm.one_thread_rows(w) == cpu_gemm.ROW_STEPS[-1]  # faster at every count
    one_s["s"] = 1.9  # within the margin: not worth it
    assert cpu_gemm.one_thread_rows(w) == 0
    one_s["s"] = 1.0
    on_threads = cpu_gemm._on_threads
    monkeypatch.setattr(cpu_gemm, "_on_threads",
                        lambda n, x, p, back=None: on_threads(n, x, p, back) + (x.shape[0] > 4))
    assert cpu_gemm.one_thread_rows(w) == 4  # other bits from 8 rows: all threads there


@_packs(torch.float32)
def test_packed_linear_takes_one_thread_up_to_the_measured_rows(two_threads: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    w = cpu_gemm.cpu_pack(torch.randn(64, 32))
    cpu_gemm._one_thread_rows[(64, 32, torch.float32, 2)] = 16
    seen: list[int] = []
    monkeypatch.setattr(cpu_gemm, "torch", _Spy(torch, seen))
    for rows in (1, 16, 17):
        cpu_gemm.packed_linear(torch.randn(rows, 32), w)
    assert seen == [1, 2, 1, 2]  # set to one thread and back for 1 and 16 rows, untouched for 17


class _Spy:
    """torch, with set_num_threads recorded."""

    def __init__(self, real: object, seen: list[int]) -> None:
        self._real, self._seen = real, seen

    def set_num_threads(self, n: int) -> None:
        self._seen.append(n)
        self._real.set_num_threads(n)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)
