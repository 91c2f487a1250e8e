"""Deterministic inference's folded norms on the GPU (models/llama.py fold_norms): the CUDA GEMV's
epilogues (the row scale of the folded RMSNorm, the residual add, the SwiGLU form with the scale) keep
the prefill tiles' bits at 1-8 rows, every ring depth, PDL on and off; the prefill's row scales
(invariant_gemv.row_scale, the squares in the order the GEMV takes them from its B fragments) are the
reference order's; and an engine with the norms folded gives one
request one answer (alone, cached, in batches, chunked, overlap off), decoded = prefilled tokens, and
CUDA graphs = eager, with greedy tokens close to the unfolded engine's."""

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
from engine.layers import invariant_gemm, invariant_gemv, ops  # noqa: E402
from engine.local import LocalEngine, Result  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"llama-qkv": (6144, 4096), "llama-o": (4096, 4096), "llama-gate_up": (28672, 4096),
          "llama-down": (4096, 14336), "qwen-qkv": (4096, 1024), "qwen-o": (1024, 2048), "qwen-gate_up": (6144, 1024),
          "qwen-down": (1024, 3072), "odd-k": (2016, 1000)}
PROMPT = [(31 * i) % 30000 + 500 for i in range(300)]
OTHERS = [[(17 * i + 7 * s) % 30000 + 500 for i in range(n)] for s, n in enumerate((1, 37, 130, 600, 5, 64), 1)]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=True)


def _built() -> None:
    if invariant_gemv.library(invariant_gemv.arch(torch.device("cuda"))) is None:
        pytest.skip("the CUDA GEMV does not build here (no nvcc)")


def _operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    x = (torch.randn(64, k, generator=g, device="cuda") * 3).to(torch.bfloat16)
    return w, x


def _depths(s: int, k: int):  # noqa: ANN202
    for st in invariant_gemv.STAGES:
        if invariant_gemv.stages_for(s, k, st) == st:
            for pdl in (False, True):
                yield st, pdl


@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_epilogues_keep_the_prefill_bits(name: str) -> None:
    _built()
    n, k = SHAPES[name]
    w, x = _operands(n, k, 4)
    r = torch.randn(64, n, device="cuda").to(torch.bfloat16)
    s = invariant_gemm.split(n, k)
    tile = (64, 128, 8, 4, 4, s)
    scale = invariant_gemv.row_scale(x, 1e-5, s, False)
    ref = invariant_gemv.row_scale_reference(x, 1e-5, s)
    assert torch.allclose(scale, ref, rtol=2**-20, atol=0), (scale - ref).abs().max()
    normed = invariant_gemm.gemm(x, w, tile=tile, norm_eps=1e-5)
    added = invariant_gemm.gemm(x, w, tile=tile, residual=r)
    assert torch.equal(added, (invariant_gemm.gemm(x, w, tile=tile).float() + r.float()).to(torch.bfloat16))
    torch.testing.assert_close(normed.float(), (x.float() * scale[:, None]) @ w.float().T, rtol=2e-2, atol=2e-2)
    bad = []
    for m in (1, 2, 5, 8):
        for st, pdl in _depths(s, k):
            out = torch.empty(m, n, dtype=x.dtype, device="cuda")
            assert invariant_gemv.gemv(x[:m], w, None, out, s, st, pdl, norm_eps=1e-5)
            bad += [] if torch.equal(out, normed[:m]) else [("norm", m, st, pdl)]
            assert invariant_gemv.gemv(x[:m], w, None, out, s, st, pdl, residual=r[:m])
            bad += [] if torch.equal(out, added[:m]) else [("residual", m, st, pdl)]
    for m in (9, 16, 17, 64):  # the triton GEMV and decode tiles
        bad += [] if torch.equal(invariant_gemm.gemm(x[:m], w, norm_eps=1e-5), normed[:m]) else [("norm", m)]
        bad += [] if torch.equal(invariant_gemm.gemm(x[:m], w, residual=r[:m]), added[:m]) else [("residual", m)]
    assert not bad, (name, bad)


@pytest.mark.parametrize("name", ["llama-gate_up", "qwen-gate_up"])
def test_gemv_act_with_the_norm_keeps_the_unfused_bits(name: str) -> None:
    _built()
    n, k = SHAPES[name]
    w, x = _operands(n, k, 5)
    s = invariant_gemm.split(n, k)
    want = ops.silu_and_mul(invariant_gemm.gemm(x, w, tile=(64, 128, 8, 4, 4, s), norm_eps=1e-6))
    bad = []
    for m in (1, 2, 5, 8):
        for st, pdl in _depths(s, k):
            out = torch.full((m, n // 2), float("nan"), dtype=x.dtype, device="cuda")
            assert invariant_gemv.gemv(x[:m], w, None, out, s, st, pdl, act=True, norm_eps=1e-6)
            bad += [] if torch.equal(out, want[:m]) else [(m, st, pdl)]
    assert not bad, (name, bad)


def _fold_tuning(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The GPU's tuning with the fold on for every model, or off (whatever the tuning file's bound)."""
    import models.llama as llama

    real, bound = llama.kernel_tuning, 1 << 20 if on else 0
    monkeypatch.setattr(llama, "kernel_tuning", lambda d: dataclasses.replace(
        real(d), det_norm_fold_max_hidden=bound, invariant_gemv_cuda=True))


@pytest.fixture
def folded(monkeypatch: pytest.MonkeyPatch) -> None:
    _fold_tuning(monkeypatch, True)


def _cut(tmp_path: Path, base: str, **cut: int) -> str:
    cfg = json.loads((REPO / "configs" / base / "config.json").read_text()) | cut
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _engine(model: str, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                                    enable_deterministic_inference=True, max_total_tokens=32768,
                                    max_running_requests=32, **kw))


def _key(r: Result) -> str:
    return str((r.output_ids, r.logprobs))


@pytest.mark.usefixtures("folded")
@pytest.mark.parametrize("base", ["qwen3-0.6b", "llama-3.2-1b"])
def test_one_request_one_answer_folded(base: str, tmp_path: Path) -> None:
    _built()
    model = _cut(tmp_path, base, num_hidden_layers=6)
    eng = _engine(model)
    assert eng.runner.model.norm_folded
    want = _key(eng.generate([PROMPT], SAMPLED)[0])
    answers = {want, _key(eng.generate([PROMPT], SAMPLED)[0])}  # cached
    for k in range(1, len(OTHERS) + 1):
        answers.add(_key(eng.generate([*OTHERS[:k], PROMPT], SAMPLED)[-1]))
    answers |= {_key(r) for r in eng.generate([PROMPT] * 5 + OTHERS[:2], SAMPLED)[:5]}
    del eng
    for cut in (16, 100, 256):
        fresh = _engine(model, disable_overlap=cut == 100, max_prefill_tokens=64 if cut == 256 else 2048)
        assert fresh.runner.model.norm_folded
        fresh.generate([PROMPT[:cut]], SamplingParams(max_new_tokens=1))
        answers.add(_key(fresh.generate([OTHERS[2], PROMPT], SAMPLED)[-1]))
        del fresh
    assert answers == {want}


@pytest.mark.usefixtures("folded")
def test_folded_decode_graphs_prefill_agree(tmp_path: Path) -> None:
    """Llama-3.2-1B cut to 4 layers, norms folded: decoded in the graphs = eager = prefilled."""
    _built()
    model = _cut(tmp_path, "llama-3.2-1b", num_hidden_layers=4)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    prompt = PROMPT[:250]
    eng = _engine(model)
    assert eng.runner.graphs is not None and eng.runner.model.norm_folded
    first = eng.generate([prompt], greedy)[0]
    assert eng.runner.graphs.replays >= greedy.max_new_tokens - 2, "decoded in the graphs"
    del eng
    eager = _engine(model, disable_cuda_graph=True)
    assert _key(eager.generate([prompt], greedy)[0]) == _key(first)
    rest = eager.generate([prompt + first.output_ids[:6]], SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True))[0]
    assert rest.output_ids == first.output_ids[6:]
    assert rest.logprobs == first.logprobs[6:]


def test_folded_engine_is_close_to_the_unfolded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold changes roundings only: the first greedy token's logprob within bf16 noise."""
    _built()
    model = _cut(tmp_path, "llama-3.2-1b", num_hidden_layers=4)
    greedy = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True, logprobs=True)
    _fold_tuning(monkeypatch, False)
    plain = _engine(model)
    assert not plain.runner.model.norm_folded
    want = plain.generate([PROMPT[:200]], greedy)[0]
    del plain
    _fold_tuning(monkeypatch, True)
    folded = _engine(model)
    assert folded.runner.model.norm_folded
    got = folded.generate([PROMPT[:200]], greedy)[0]
    assert abs(got.logprobs[0] - want.logprobs[0]) < 0.05, (got.logprobs, want.logprobs)
