"""Deterministic inference's residual-stream norm folded into the CUDA GEMVs (engine/layers/
invariant_norm.py, invariant_gemv.cu): the norm kernel's rows keep their bits at any row count and
stay close to a float64 norm; a producer GEMV adding into the residual and a consumer GEMV
normalizing its tiles give the bits of the unfolded path (prefill tiles, the norm kernel, the
prefill tiles again; SwiGLU's epilogue too); and an engine with the fold on (the tuning key
patched on) keeps one answer per request, in CUDA graphs as eagerly. The tuning key decides the
fold's use; these tests are its condition."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.config import ServerConfig  # noqa: E402
from engine.layers import invariant_gemm, invariant_gemv, invariant_norm, ops  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BF = torch.bfloat16
EPS = 1e-5
SHAPES = {  # hidden, (qkv rows, gate_up rows): Llama-3.1-8B, Qwen3-0.6B
    "llama": (4096, 6144, 28672), "qwen": (1024, 4096, 6144),
}


def _built() -> None:
    if invariant_gemv.library(invariant_gemv.arch(torch.device("cuda"))) is None:
        pytest.skip("the CUDA kernels do not build here (no nvcc)")


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF)


@pytest.mark.parametrize("name", list(SHAPES))
def test_norm_rows_keep_their_bits_and_are_close(name: str) -> None:
    _built()
    h = SHAPES[name][0]
    x, r, w = _randn(64, h, seed=1), _randn(64, h, seed=2), _randn(h, scale=0.1, seed=3) + 1
    r64 = r.clone()
    full, res = invariant_gemv.rms_norm(x, r64, w, EPS, False)
    for m in (1, 2, 7, 8, 33):
        rm = r[:m].clone()
        out, got = invariant_gemv.rms_norm(x[:m].contiguous(), rm, w, EPS, True)
        assert torch.equal(out, full[:m]) and torch.equal(got, res[:m]), m
    s = x.double() + r.double()
    want = (s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS)) * w.double()
    torch.testing.assert_close(full.double(), want, atol=0.05, rtol=0.02)
    alone, same = invariant_gemv.rms_norm(x, None, w, EPS, False)
    assert same is x
    torch.testing.assert_close(alone.double(), (x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True)
                                                                         + EPS)) * w.double(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", list(SHAPES))
def test_folded_gemvs_give_the_unfolded_bits(name: str) -> None:
    """o_proj's GEMV adding into the residual, then qkv's (and gate_up's with SwiGLU) normalizing:
    the bits of o_proj by the prefill tiles, the norm kernel, qkv by the prefill tiles."""
    _built()
    h, n_qkv, n_gu = SHAPES[name]
    w_o, w_qkv, w_gu = (_randn(n, h, scale=h**-0.5, seed=s) for n, s in ((h, 4), (n_qkv, 5), (n_gu, 6)))
    w_n = _randn(h, scale=0.1, seed=7) + 1
    x, r = _randn(8, h, seed=8), _randn(8, h, seed=9)
    for m in (1, 3, 8):
        # unfolded: every product by the prefill tiles, the norm kernel between
        y = invariant_gemm.gemm(x, w_o, tile=(64, 128, 8, 4, 4, invariant_gemm.split(h, h)))[:m]
        r_ref = r[:m].clone()
        normed, _ = invariant_gemv.rms_norm(y, r_ref, w_n, EPS, False)
        qkv_ref = invariant_gemm.gemm(normed, w_qkv, tile=(64, 128, 8, 4, 4, invariant_gemm.split(n_qkv, h)))
        gu_ref = ops.silu_and_mul(invariant_gemm.gemm(normed, w_gu, tile=(64, 128, 8, 4, 4,
                                                                          invariant_gemm.split(n_gu, h))))
        for pdl in (False, True):
            r_fold = r[:m].clone()
            parts = torch.full((m, h // 16), float("nan"), device="cuda")
            s = invariant_gemm.split(h, h)
            assert invariant_gemv.gemv(x[:m].contiguous(), w_o, None, r_fold, s, invariant_gemv.stages_for(s, h), pdl,
                                       partials=parts)
            assert torch.equal(r_fold, r_ref), (m, pdl, "the residual")
            for w, act, want in ((w_qkv, False, qkv_ref), (w_gu, True, gu_ref)):
                n = w.shape[0]
                s = invariant_gemm.split(n, h)
                out = torch.full((m, n // 2 if act else n), float("nan"), dtype=BF, device="cuda")
                assert invariant_gemv.gemv(r_fold, w, None, out, s, invariant_gemv.stages_for(s, h), pdl, act=act,
                                           partials=parts, norm=(w_n, EPS))
                assert torch.equal(out, want), (m, pdl, act, (out.float() - want.float()).abs().max().item())


def _engine(model: str, graphs: bool) -> LocalEngine:
    return LocalEngine(ServerConfig(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                                    enable_deterministic_inference=True, max_total_tokens=32768,
                                    max_running_requests=32, disable_cuda_graph=not graphs))


def test_engine_with_the_fold_keeps_one_answer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Qwen3-0.6B shapes cut to 4 layers, the tuning's invariant_norm_fold (and the CUDA GEMV) on:
    a prompt's greedy tokens and logprobs decoded alone (1 row: the folded GEMVs) equal those
    decoded in a batch of 12 rows (the norm kernel between the decode tiles), and the graphs' bits
    equal eager's."""
    _built()
    tuned = dataclasses.replace(invariant_norm.kernel_tuning(torch.device("cuda")), invariant_norm_fold=True,
                                invariant_gemv_cuda=True)
    monkeypatch.setattr(invariant_norm, "kernel_tuning", lambda device: tuned)
    monkeypatch.setattr(invariant_gemm, "kernel_tuning", lambda device: tuned)
    cfg = json.loads((REPO / "configs" / "qwen3-0.6b" / "config.json").read_text()) | {"num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    prompt = [(31 * i) % 30000 + 500 for i in range(150)]
    others = [[(17 * i + 7 * s) % 30000 + 500 for i in range(n)]
              for s, n in enumerate((1, 37, 130, 300, 5, 64, 9, 200, 17, 90, 3), 1)]
    folds = []
    add_into = invariant_norm.add_into
    monkeypatch.setattr(invariant_norm, "add_into", lambda *a: folds.append(1) or add_into(*a))
    answers = {}
    for graphs in (False, True):
        eng = _engine(str(tmp_path), graphs)
        r = eng.generate([prompt], greedy)[0]
        assert folds, "the decode steps folded the norms"
        answers[(graphs, "alone")] = (r.output_ids, r.logprobs)
        r = eng.generate([*others, prompt], greedy)[-1]
        answers[(graphs, "batch")] = (r.output_ids, r.logprobs)
        del eng
    assert len({str(v) for v in answers.values()}) == 1, {k: v[0][:8] for k, v in answers.items()}
