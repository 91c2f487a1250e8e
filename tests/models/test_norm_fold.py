"""Deterministic inference's folded norms (models/llama.py fold_norms) on a CPU: each layer's two
RMSNorms folded into the GEMMs around them (the norm's weight in qkv_proj's / gate_up_proj's
columns, the rows scaled in the invariant GEMM's epilogue; o_proj and down_proj adding the residual
in theirs), run by triton's interpreter in float32, give the unfolded model's logits and greedy
tokens, batched and chunked; a folded layer hands on the residual stream itself. The CUDA kernels'
bits: tests/gpu/test_norm_fold_gpu.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: the GEMMs run interpreted

import pytest  # noqa: E402
import torch  # noqa: E402
from model_harness import PagedGreedy, make_hf_dir, tiny_config  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.llama import LlamaForCausalLM, fold_layers, fold_norms, residual_stream  # noqa: E402
from models.loader import load_safetensors  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("vendor_kernels")


def _model(path) -> tuple[LlamaForCausalLM, ModelConfig]:  # noqa: ANN001
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, torch.float32)
    load_safetensors(model, cfg, path, progress=False)
    return model.eval(), cfg


def _greedy(model: LlamaForCausalLM, cfg: ModelConfig, prompts: list[list[int]], chunk: int | None) -> list:
    runner = PagedGreedy(model, cfg, page_size=4)
    seqs = [runner.new_seq(p, 5) for p in prompts]
    runner.run(seqs, 5, chunk=chunk)
    return seqs


def test_folded_layers_give_the_unfolded_logits(tmp_path) -> None:  # noqa: ANN001
    path = make_hf_dir(tmp_path / "m", tiny_config("tiny-qwen3"), std=0.2)
    plain, cfg = _model(path)
    folded, _ = _model(path)
    with torch.no_grad():  # the norm weights far from 1, so that folding them matters
        for layer in list(plain.model.layers):
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(norm.weight)))
        folded.load_state_dict(plain.state_dict())
    assert not fold_norms(folded), "a CPU model is not folded by the engine (the CUDA kernels' path)"
    fold_layers(folded)
    assert folded.norm_folded and all(layer.folded for layer in folded.model.layers)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 22)]
    # the last case alone: its first chunks sample no row (the forward answers no logits, from the stream)
    for batch, chunk in ((prompts, None), (prompts, 7), (prompts[2:], 7)):
        want = _greedy(plain, cfg, batch, chunk)
        got = _greedy(folded, cfg, batch, chunk)
        for w, o in zip(want, got, strict=True):
            assert o.out == w.out
            torch.testing.assert_close(torch.stack(o.logits), torch.stack(w.logits), rtol=1e-4, atol=1e-4)


def test_folded_layer_returns_the_residual_stream() -> None:
    """A folded layer returns (None, stream): residual_stream (the self-draft's final norm) takes the
    stream as it is."""
    stream = torch.randn(3, 8)
    assert residual_stream(None, stream) is stream
    x = torch.randn(3, 8)
    assert torch.equal(residual_stream(x, stream), x + stream)
