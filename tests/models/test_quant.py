"""Quantized checkpoints on the CPU (issue 23): each on-disk format that production checkpoints
ship, written by scripts/quantize_checkpoint.py from a tiny random Llama and Qwen3, loads into
exactly the weights of the same checkpoint dequantized to float32 by the script's own code, and
generates the same greedy tokens and logits. Plus `--quantization fp8`, dummy quantized
weights, and the errors that name the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_harness import PagedGreedy, make_hf_dir
from safetensors.torch import load_file, save_file

from models.quant import read_scheme
from models.registry import load_model
from scripts.quantize_checkpoint import FORMATS, dequantize_dir, quantize_dir

# dims that are whole 128-blocks in every fused piece (q 256, k/v 128, gate/up 256)
BASE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "eos_token_id": 2, "bos_token_id": 1}
MODELS = {
    "llama": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1e6,
              "tie_word_embeddings": True, "use_sliding_window": False},
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [200, 11, 64]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make_hf_dir(tmp_path_factory.mktemp(name), cfg, seed=3) for name, cfg in MODELS.items()}


def _greedy(path: Path, n: int = 12, **kw: object) -> tuple[list[list[int]], torch.nn.Module]:
    model, cfg = load_model(path, progress=False, **kw)
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, n) for p in PROMPTS]
    runner.run(seqs, n)
    return [s.out for s in seqs], model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_format_loads_as_its_dequantized_weights(plain: dict[str, Path], tmp_path: Path, arch: str,
                                                 fmt: str) -> None:
    qdir = quantize_dir(plain[arch], tmp_path / "q", fmt)
    assert read_scheme(json.loads((qdir / "config.json").read_text()), qdir) is not None
    ref = dequantize_dir(qdir, tmp_path / "ref")
    got, model = _greedy(qdir)
    want, ref_model = _greedy(ref)
    for (name, p), (rname, r) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert name == rname and torch.equal(p, r), name  # the engine read every scale where it belongs
    assert got == want
    # and the quantization is real: the dequantized weights are not the original ones
    orig = load_file(plain[arch] / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    down = model.model.layers[0].mlp.down_proj.weight
    assert not torch.equal(down, orig) and torch.allclose(down, orig, atol=0.35 * float(orig.abs().max()))


def test_online_fp8_is_per_channel_e4m3(plain: dict[str, Path]) -> None:
    model, _ = load_model(plain["llama"], progress=False, quantization="fp8")
    w = load_file(plain["llama"] / "model.safetensors")["model.layers.1.self_attn.o_proj.weight"].float()
    s = w.abs().amax(1, keepdim=True) / 448.0
    want = (w / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, want)
    plain_model, _ = load_model(plain["llama"], progress=False)
    assert not torch.equal(want, plain_model.model.layers[1].self_attn.o_proj.weight)
    with pytest.raises(ValueError, match="unknown --quantization 'int4'"):
        load_model(plain["llama"], progress=False, quantization="int4")


def test_fp8_flag_on_a_quantized_checkpoint(plain: dict[str, Path], tmp_path: Path) -> None:
    """--quantization fp8 on an FP8 checkpoint: its own scheme wins; on an NVFP4 one: refused."""
    from models.config import ModelConfig
    from models.registry import quant_scheme

    fp8 = quantize_dir(plain["llama"], tmp_path / "fp8", "fp8-block")
    cfg = ModelConfig.from_dir(fp8)
    assert quant_scheme(cfg, "fp8") == cfg.quant and cfg.quant.format == "fp8_block"
    nvfp4 = ModelConfig.from_dir(quantize_dir(plain["llama"], tmp_path / "nv", "modelopt-nvfp4"))
    with pytest.raises(ValueError, match=r"--quantization fp8: the checkpoint is already quantized \(nvfp4"):
        quant_scheme(nvfp4, "fp8")
    assert quant_scheme(nvfp4, None) == nvfp4.quant


@pytest.mark.parametrize("fmt", ["fp8-block", "modelopt-nvfp4"])
def test_dummy_weights_follow_the_quantized_config(plain: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    qdir = quantize_dir(plain["qwen3"], tmp_path / "q", fmt)
    (qdir / "model.safetensors").unlink()  # dummy needs only the config
    toks, model = _greedy(qdir, n=4, load_format="dummy")
    assert all(len(t) == 4 for t in toks)
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    if fmt == "modelopt-nvfp4":  # every group of 16 is an e2m1 multiple of one scale: at most 8 magnitudes
        assert all(len(g.abs().unique()) <= 8 for g in w.reshape(-1, 16)[:64])


def _config(path: Path, edit: callable) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda q: q.update(quant_method="gptq"), r"quantization_config\.quant_method 'gptq' is not supported"),
    (lambda q: q.update(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\] is not supported"),
    (lambda q: q.update(fmt="e5m2"), r"quantization_config\.fmt 'e5m2'"),
    # an audit: these two were served (vLLM refuses the first; the second's strings were int()-ed)
    (lambda q: q.update(activation_scheme="static"), r"activation_scheme 'static' with weight_block_size"),
    (lambda q: q.update(weight_block_size=["128", "128"]), r"weight_block_size must be \[n, k\] \(integers\)"),
    # per-channel fp8 then, and the block scales were only "unexpected tensors"
    (lambda q: q.update(weight_block_size=None), r"unexpected tensors: .*fp8 with weight_block_size"),
])
def test_unsupported_fp8_fields_are_named(plain: dict[str, Path], tmp_path: Path, edit: callable,
                                           message: str) -> None:
    qdir = quantize_dir(plain["llama"], tmp_path / "q", "fp8-block")
    _config(qdir, lambda c: edit(c["quantization_config"]))
    with pytest.raises(ValueError, match=message):
        load_model(qdir, progress=False)


def test_unsupported_compressed_tensors_and_modelopt_are_named(plain: dict[str, Path], tmp_path: Path) -> None:
    ct = quantize_dir(plain["llama"], tmp_path / "ct", "ct-channel")
    _config(ct, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        num_bits=4, type="int"))
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights num_bits 4 type 'int'"):
        load_model(ct, progress=False)
    ct_act = quantize_dir(plain["llama"], tmp_path / "ct_act", "ct-channel")
    _config(ct_act, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True}))
    with pytest.raises(ValueError, match=r"input_activations \(type 'int', num_bits 8\) is not supported"):
        load_model(ct_act, progress=False)
    ct_block = quantize_dir(plain["llama"], tmp_path / "ct_block", "ct-channel")
    _config(ct_block, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        strategy="block", block_structure=[64, 64]))
    with pytest.raises(ValueError, match=r"weights\.block_structure \[64, 64\] is not supported"):
        load_model(ct_block, progress=False)
    mo = quantize_dir(plain["llama"], tmp_path / "mo", "modelopt-fp8")
    q = json.loads((mo / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "W4A8_AWQ"
    (mo / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(ValueError, match=r"quant_algo 'W4A8_AWQ' is not supported"):
        load_model(mo, progress=False)


def test_a_plain_tensor_where_the_config_says_fp8_is_named(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["llama"], tmp_path / "q", "ct-channel")
    f = qdir / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape, dtype=torch.bfloat16)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} is stored as BF16"):
        load_model(qdir, progress=False)


def test_an_integer_tensor_where_a_float_weight_goes_is_named(plain: dict[str, Path], tmp_path: Path) -> None:
    """An audit: an int8 tensor (a GPTQ/AWQ-style checkpoint without its quantization config) was cast
    to float and served: numbers of the wrong scale, no error."""
    qdir = tmp_path / "int"
    shutil.copytree(plain["llama"], qdir)
    f = next(qdir.glob("*.safetensors"))
    tensors = load_file(f)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.randint(-127, 127, tensors[name].shape, dtype=torch.int8)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} is stored as I8, an integer type"):
        load_model(qdir, progress=False)


def test_missing_scale_is_named(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["llama"], tmp_path / "q", "fp8-block")
    f = qdir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, f, metadata={"format": "pt"})
    # the checkpoint's name of what is missing (an audit: the engine's qkv_proj.weight_scale[k] named nothing there)
    missing = r"lacks 1 tensor\(s\): model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv$"
    with pytest.raises(ValueError, match=missing):
        load_model(qdir, progress=False)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_fp8_block_agrees_with_transformers(plain: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """transformers loads the fp8-block format on a CPU by dequantizing it (its FineGrainedFP8
    path; the compressed-tensors and ModelOpt formats need packages or a GPU it lacks here): the
    same float32 weights as ours, and the same greedy tokens."""
    from model_harness import hf_greedy, load_hf

    qdir = quantize_dir(plain[arch], tmp_path / "q", "fp8-block")
    hf = load_hf(qdir)
    got, model = _greedy(qdir)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(hf.model.layers[1].self_attn.q_proj.weight, qkv[: model.config.q_size])
    assert got == [hf_greedy(hf, p, len(got[0]))[0] for p in PROMPTS]


def test_the_block_fp8_deepseek_config_is_the_plain_one_with_deepseeks_quantization() -> None:
    """configs/deepseek-v3-5l-fp8 (the GPU benchmarks' block-FP8 DeepSeek, dummy weights): the plain
    5-layer config plus the quantization_config DeepSeek-V3's checkpoint ships, read as 128 x 128 fp8."""
    configs = Path(__file__).resolve().parents[2] / "configs"
    fp8 = json.loads((configs / "deepseek-v3-5l-fp8" / "config.json").read_text())
    plain = json.loads((configs / "deepseek-v3-5l" / "config.json").read_text())
    q = fp8.pop("quantization_config")
    assert fp8 == plain and (q["quant_method"], q["weight_block_size"]) == ("fp8", [128, 128])
    scheme = read_scheme({**fp8, "quantization_config": q})
    assert scheme is not None and (scheme.format, scheme.block) == ("fp8_block", (128, 128))
