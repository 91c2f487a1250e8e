"""Weight loading: sharded checkpoints, clear errors, dummy weights, the registry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_harness import CONFIGS, PagedGreedy, hf_greedy, load_hf, make_hf_dir, tiny_config
from safetensors.torch import load_file, save_file

from models.registry import get_model_class, load_model, supported_architectures


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("llama"), tiny_config("tiny-llama"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path: Path, edit: callable) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_sharded_checkpoint_loads(llama_dir: Path, tmp_path: Path) -> None:
    hf = load_hf(llama_dir)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded, _ = load_model(tmp_path, progress=False)
    single, cfg = load_model(llama_dir, progress=False)
    for (n1, p1), (n2, p2) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    runner = PagedGreedy(sharded, cfg)
    seq = runner.new_seq([5, 6, 7, 8, 9], 4)
    runner.run([seq], 4)
    assert seq.out == hf_greedy(hf, [5, 6, 7, 8, 9], 4)[0]


def test_fused_slices_land_in_place(llama_dir: Path) -> None:
    model, cfg = load_model(llama_dir, progress=False)
    hf = load_file(llama_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: cfg.q_size], hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[cfg.q_size + cfg.kv_size :], hf["model.layers.1.self_attn.v_proj.weight"])
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[cfg.intermediate_size :], hf["model.layers.0.mlp.up_proj.weight"])


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    # an audit: the message named the engine's fused piece (qkv_proj.weight[k]), not the checkpoint's tensor
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight$"):
        load_model(path, progress=False)


def test_checkpoint_names_undo_the_engine_names() -> None:
    from types import SimpleNamespace

    from models.loader import checkpoint_name, map_name

    block = SimpleNamespace(quant=SimpleNamespace(checkpoint_scale="weight_scale_inv"))
    plain = SimpleNamespace(quant=None)
    for hf in ("model.layers.3.mlp.experts.5.up_proj.weight", "model.layers.3.mlp.experts.0.gate_proj.weight_scale",
               "model.layers.3.mlp.experts.7.down_proj.weight_scale_2", "model.layers.0.self_attn.v_proj.weight",
               "model.layers.0.mlp.gate_proj.weight", "model.norm.weight"):
        assert checkpoint_name(*map_name(hf), plain) == hf
    assert checkpoint_name("model.layers.0.mlp.down_proj.weight_scale", None, block) == \
        "model.layers.0.mlp.down_proj.weight_scale_inv"


def test_unexpected_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(path, progress=False)


def test_shape_mismatch_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\), expected \(64,\)"):
        load_model(path, progress=False)


def test_no_weights_and_quantized_rejected(llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(llama_dir / "config.json", path)
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(path, progress=False)
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.quant_method 'awq' is not supported"):
        load_model(path, load_format="safetensors", progress=False)


def test_dummy_is_deterministic() -> None:
    a, cfg = load_model(CONFIGS / "tiny-qwen3", load_format="dummy")
    b, _ = load_model(CONFIGS / "tiny-qwen3", load_format="dummy")
    c, _ = load_model(CONFIGS / "tiny-qwen3", load_format="dummy", seed=1)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    assert torch.all(pa["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert 0.015 < pa["model.layers.0.mlp.down_proj.weight"].std() < 0.025
    assert cfg.tie_word_embeddings and a.lm_head is None
    runner = PagedGreedy(a, cfg)
    seq = runner.new_seq([1, 2, 3], 3)
    runner.run([seq], 3)  # dummy weights run end to end
    assert len(seq.out) == 3


def test_dummy_bf16_dtype() -> None:
    model, _ = load_model(CONFIGS / "tiny-llama", load_format="dummy", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_registry() -> None:
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(
        supported_architectures()
    )
    assert get_model_class("Qwen3ForCausalLM").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(CONFIGS / "tiny-llama", load_format="pt")
