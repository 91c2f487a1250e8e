"""Quantized MoE checkpoints on the CPU (issues 22 and 23): every routed expert's gate/up/down in
fp8 (128x128 blocks with `weight_scale_inv`, as DeepSeek-V3 and Qwen3-*-FP8 ship; or per
channel / per tensor, as compressed-tensors and ModelOpt do), written by
scripts/quantize_checkpoint.py from tiny random Qwen3-MoE, GLM-4.5 and DeepSeek-V3 checkpoints, load into
exactly the weights of the same checkpoint dequantized to float32 by the script's own code, and
decode the same greedy tokens. Also: the GPU's path (experts kept in fp8, dequantized per
forward) run on the CPU, dummy and online-fp8 expert stacks. NVFP4 experts (ModelOpt: e2m1
pairs, e4m3 scales per 16, a global scale per expert matrix) likewise, plus their tensor-parallel
shards and the split that would cut a group of 16."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_harness import PagedGreedy, make_hf_dir
from safetensors.torch import load_file, save_file
from test_mla import TINY_V3

from engine.layers import quant
from engine.layers.moe import Experts
from engine.layers.parallel import ParallelState, TPGroup, set_parallel_state, sharding_of
from models.config import ModelConfig
from models.loader import init_dummy, load_safetensors
from models.quant_weights import dequantize_model, prepare_model, quantize_model, runtime_form
from models.registry import get_model_class, load_model
from scripts.quantize_checkpoint import dequantize_dir, quantize_dir

# whole 128-blocks in every fused piece: q 256, k/v 128, gate/up 256 (dense) and 128 (experts)
_BASE = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "eos_token_id": 2, "bos_token_id": 1, "num_experts_per_tok": 2, "rope_theta": 10000.0}
MODELS = {
    "qwen3-moe": _BASE | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 5,
                          "norm_topk_prob": True, "mlp_only_layers": [1]},
    "glm4-moe": _BASE | {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": 7,
                         "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                         "norm_topk_prob": True, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
                         "attention_bias": True, "use_qk_norm": True},
    # MLA (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj: a matrix the engine keeps plain, dequantized at
    # load), 9 experts in 3 groups (noaux_tc), a shared expert, YaRN
    "deepseek-v3": TINY_V3 | {"intermediate_size": 128, "moe_intermediate_size": 128, "num_hidden_layers": 2,
                              "first_k_dense_replace": 1},
}
MOE_LAYER = {"qwen3-moe": 0, "glm4-moe": 1, "deepseek-v3": 1}  # the other layer is dense
PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [200, 11, 64]]
N = 12


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make_hf_dir(tmp_path_factory.mktemp(name), cfg, seed=3) for name, cfg in MODELS.items()}


def _greedy(model: torch.nn.Module, cfg: ModelConfig) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, N) for p in PROMPTS]
    runner.run(seqs, N)
    return [s.out for s in seqs], [torch.stack(s.logits) for s in seqs]


def _experts(model: torch.nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "modelopt-fp8"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_quantized_experts_load_as_their_dequantized_weights(plain: dict[str, Path], tmp_path: Path, arch: str,
                                                             fmt: str) -> None:
    qdir = quantize_dir(plain[arch], tmp_path / "q", fmt)
    stored, layer = load_file(qdir / "model.safetensors"), f"model.layers.{MOE_LAYER[arch]}.mlp"
    assert stored[f"{layer}.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{layer}.gate.weight"].dtype == torch.float32  # the router stays
    if arch == "deepseek-v3":  # stored in e4m3 like every projection, dequantized at load on any device
        assert stored["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    ref = dequantize_dir(qdir, tmp_path / "ref")
    model, cfg = load_model(qdir, progress=False)
    ref_model, _ = load_model(ref, progress=False)
    for (name, p), (rname, r) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert name == rname and torch.equal(p, r), name  # every expert's scale read where it belongs
    assert _greedy(model, cfg)[0] == _greedy(ref_model, cfg)[0]
    # the quantization is real: expert 3's down projection is not the original one
    orig = load_file(plain[arch] / "model.safetensors")[f"{layer}.experts.3.down_proj.weight"]
    down = _experts(model)[0].w2[3]
    assert not torch.equal(down, orig) and torch.allclose(down, orig, atol=0.1 * float(orig.abs().max()))


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel"])
def test_fp8_experts_dequantized_per_forward_match(plain: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """The GPU's path on the CPU: the expert stacks stay e4m3 (only the Linears are made plain)
    and each forward dequantizes the experts that got tokens: the same logits, bit for bit."""
    qdir = quantize_dir(plain["glm4-moe"], tmp_path / "q", fmt)
    cfg = ModelConfig.from_dir(qdir)
    model = get_model_class(cfg.architecture)(cfg, torch.float32)
    assert prepare_model(model, cfg.quant) > 0
    load_safetensors(model, cfg, qdir, progress=False)
    for m in model.modules():
        if getattr(m, "quant", None) is not None and not isinstance(m, Experts):
            quant.to_plain(m, torch.float32)
    stacks = _experts(model)
    assert stacks and all(x.quant is not None and x.w13.dtype == torch.float8_e4m3fn for x in stacks)
    ref_model, _ = load_model(qdir, progress=False)  # dequantized once, at load
    got, want = _greedy(model.eval(), cfg), _greedy(ref_model, cfg)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_dummy_fp8_block_builds_quantized_expert_stacks(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["qwen3-moe"], tmp_path / "q", "fp8-block")
    cfg = ModelConfig.from_dir(qdir)
    model = get_model_class(cfg.architecture)(cfg, torch.bfloat16)
    init_dummy(model)
    quantize_model(model, cfg.quant)
    (x,) = _experts(model)
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    assert x.w13.dtype == x.w2.dtype == torch.float8_e4m3fn
    assert x.w13.shape == (e, 2 * i, h) and x.w13_scale.shape == (e, 2 * i // 128, h // 128)
    assert x.w2.shape == (e, h, i) and x.w2_scale.shape == (e, h // 128, i // 128)
    assert (x.w13_scale > 0).all() and (x.w2_scale > 0).all()
    assert dequantize_model(model, torch.bfloat16) > 0 and x.w13.dtype == torch.bfloat16
    # and the whole load path with dummy weights decodes (on the CPU: dequantized at load)
    (qdir / "model.safetensors").unlink()
    model, cfg = load_model(qdir, load_format="dummy", progress=False)
    toks, _ = _greedy(model, cfg)
    assert all(len(t) == N for t in toks)


def test_online_fp8_quantizes_experts_per_channel(plain: dict[str, Path]) -> None:
    model, _ = load_model(plain["qwen3-moe"], progress=False, quantization="fp8")
    w = load_file(plain["qwen3-moe"] / "model.safetensors")["model.layers.0.mlp.experts.4.up_proj.weight"].float()
    s = w.abs().amax(1, keepdim=True) / 448.0
    want = (w / s).to(torch.float8_e4m3fn).float() * s
    i = w.shape[0]
    assert torch.equal(_experts(model)[0].w13[4, i:], want)


def test_partly_ignored_experts_are_named(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["qwen3-moe"], tmp_path / "q", "fp8-block")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts.2.down_proj")
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"covers only some projections of the experts in model\.layers\.0"):
        load_model(qdir, progress=False)


def test_kv_b_proj_without_its_scale_is_named(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["deepseek-v3"], tmp_path / "q", "fp8-block")
    tensors = load_file(qdir / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(tensors, qdir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.kv_b_proj\.weight has e4m3 values but not"):
        load_model(qdir, progress=False)


# ---- NVFP4 experts (engine/layers/moe_quant.py format `nvfp4`)
F4_ATOL = 0.25  # of a tensor's largest magnitude: e2m1 keeps 8 magnitudes a group of 16


@pytest.fixture
def parallel() -> Iterator[None]:
    yield
    set_parallel_state(ParallelState())  # the default back for the other tests


def _close_not_equal(got: torch.Tensor, orig: torch.Tensor) -> bool:
    """The quantization is real (not the original values) and close to them."""
    return not torch.equal(got, orig) and torch.allclose(got, orig, atol=F4_ATOL * float(orig.abs().max()))


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_nvfp4_experts_load_as_their_dequantized_weights(plain: dict[str, Path], tmp_path: Path, arch: str) -> None:
    qdir = quantize_dir(plain[arch], tmp_path / "q", "modelopt-nvfp4")
    stored, layer = load_file(qdir / "model.safetensors"), f"model.layers.{MOE_LAYER[arch]}.mlp"
    down = f"{layer}.experts.3.down_proj."
    assert stored[down + "weight"].dtype == torch.uint8 and stored[down + "weight_scale"].dtype == torch.float8_e4m3fn
    assert stored[down + "weight_scale_2"].shape == () and down + "input_scale" in stored  # read past
    if arch != "qwen3-moe":  # shared experts: dense NVFP4 Linears
        assert stored[f"{layer}.shared_experts.up_proj.weight"].dtype == torch.uint8
    if arch == "deepseek-v3":  # MLA's attention stays float32, listed in exclude_modules
        assert stored["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32
    ref = dequantize_dir(qdir, tmp_path / "ref")
    model, cfg = load_model(qdir, progress=False)
    ref_model, _ = load_model(ref, progress=False)
    for (name, p), (rname, r) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert name == rname and torch.equal(p, r), name  # every expert's scales read where they belong
    assert _greedy(model, cfg)[0] == _greedy(ref_model, cfg)[0]
    orig = load_file(plain[arch] / "model.safetensors")[down + "weight"]
    assert _close_not_equal(_experts(model)[0].w2[3], orig)


def test_nvfp4_experts_kept_packed_match_and_keep_gate_and_up_scales(plain: dict[str, Path], tmp_path: Path) -> None:
    """The stacks as the loader fills them (before any dequantization): gate and up rows of w13
    carry their own global scales, and dequantizing per forward (the torch path) gives the same
    logits, bit for bit, as the stacks dequantized at load."""
    qdir = quantize_dir(plain["glm4-moe"], tmp_path / "q", "modelopt-nvfp4")
    cfg = ModelConfig.from_dir(qdir)
    model = get_model_class(cfg.architecture)(cfg, torch.float32)
    assert prepare_model(model, cfg.quant) > 0
    load_safetensors(model, cfg, qdir, progress=False)
    for m in model.modules():
        if getattr(m, "quant", None) is not None and not isinstance(m, Experts):
            quant.to_plain(m, torch.float32)
    (x,) = _experts(model)
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    assert x.quant == "nvfp4" and x.w13.dtype == torch.uint8 and x.w13.shape == (e, 2 * i, h // 2)
    stored = load_file(qdir / "model.safetensors")
    for j in range(e):
        for proj, rows in (("gate_proj", x.w13_scale_2[j, :i]), ("up_proj", x.w13_scale_2[j, i:])):
            assert torch.equal(rows, stored[f"model.layers.1.mlp.experts.{j}.{proj}.weight_scale_2"].expand(i))
        assert torch.equal(x.w2_scale[j], stored[f"model.layers.1.mlp.experts.{j}.down_proj.weight_scale"])
    assert not torch.equal(x.w13_scale_2[0, :i], x.w13_scale_2[0, i:])
    ref_model, _ = load_model(qdir, progress=False)
    got, want = _greedy(model.eval(), cfg), _greedy(ref_model, cfg)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_dummy_nvfp4_expert_stacks_and_the_cuda_form(plain: dict[str, Path], tmp_path: Path) -> None:
    qdir = quantize_dir(plain["qwen3-moe"], tmp_path / "q", "modelopt-nvfp4")
    cfg = ModelConfig.from_dir(qdir)
    model = get_model_class(cfg.architecture)(cfg, torch.bfloat16)
    init_dummy(model)
    (x,) = _experts(model)
    drawn, sh = x.w13.detach().float().clone(), sharding_of(x.w13)
    quantize_model(model, cfg.quant)
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    assert x.w13.dtype == x.w2.dtype == torch.uint8
    assert x.w13_scale.dtype == x.w2_scale.dtype == torch.float8_e4m3fn
    assert x.w13_scale_2.dtype == x.w2_scale_2.dtype == torch.float32
    assert (x.w13.shape, x.w13_scale.shape, x.w13_scale_2.shape) == ((e, 2 * i, h // 2), (e, 2 * i, h // 16),
                                                                     (e, 2 * i))
    assert (x.w2.shape, x.w2_scale.shape, x.w2_scale_2.shape) == ((e, h, i // 2), (e, h, i // 16), (e, h))
    assert (x.w13_scale_2 > 0).all() and (x.w2_scale_2 > 0).all()
    # CUDA's form is chosen by the device type: the expert stacks plain in the model dtype (the
    # fused kernels read no NVFP4), every Linear still NVFP4 (its own dequantizing GEMM)
    assert runtime_form(model, torch.bfloat16, torch.device("cuda")) == 1
    assert x.quant is None and x.w13.dtype == torch.bfloat16 and x.w13.shape == (e, 2 * i, h)
    assert not hasattr(x, "w13_scale") and not hasattr(x, "w2_scale_2") and sharding_of(x.w13) == sh
    assert _close_not_equal(x.w13.float(), drawn)
    assert model.model.layers[0].self_attn.qkv_proj.quant == "nvfp4"
    (qdir / "model.safetensors").unlink()  # and the whole dummy load path decodes (CPU: all plain)
    model, cfg = load_model(qdir, load_format="dummy", progress=False)
    toks, _ = _greedy(model, cfg)
    assert all(len(t) == N for t in toks)


def test_nvfp4_tp_ranks_hold_their_slices(plain: dict[str, Path], tmp_path: Path, parallel: None) -> None:
    """tp=2, each rank simulated in process: w13 split by rows (gate and up each), w2 by K in
    packed bytes and groups; each rank's dequantized stacks are its slices of tp=1's."""
    qdir = quantize_dir(plain["qwen3-moe"], tmp_path / "q", "modelopt-nvfp4")
    one = _experts(load_model(qdir, progress=False)[0])[0]
    i = one.w2.shape[2]
    for r in (0, 1):
        set_parallel_state(ParallelState(tp=TPGroup(r, 2)))
        x = _experts(load_model(qdir, progress=False)[0])[0]
        a, b = r * i // 2, (r + 1) * i // 2
        assert torch.equal(x.w13, torch.cat([one.w13[:, a:b], one.w13[:, i + a : i + b]], 1))
        assert torch.equal(x.w2, one.w2[:, :, a:b])


def test_nvfp4_ep_ranks_hold_their_experts(tmp_path: Path, parallel: None) -> None:
    """ep=2 (whole experts per rank, simulated in process): each rank's stacks are its experts of ep=1's."""
    src = make_hf_dir(tmp_path / "plain", MODELS["glm4-moe"] | {"n_routed_experts": 6}, seed=3)
    qdir = quantize_dir(src, tmp_path / "q", "modelopt-nvfp4")
    one = _experts(load_model(qdir, progress=False)[0])[0]
    for r in (0, 1):
        set_parallel_state(ParallelState(ep=TPGroup(r, 2)))
        x = _experts(load_model(qdir, progress=False)[0])[0]
        assert torch.equal(x.w13, one.w13[3 * r : 3 * r + 3]) and torch.equal(x.w2, one.w2[3 * r : 3 * r + 3])


def test_a_tp_split_that_cuts_an_nvfp4_group_is_named(plain: dict[str, Path], tmp_path: Path,
                                                       parallel: None) -> None:
    qdir = quantize_dir(plain["qwen3-moe"], tmp_path / "q", "modelopt-nvfp4")
    (qdir / "model.safetensors").unlink()
    cfg = json.loads((qdir / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps(cfg | {"moe_intermediate_size": 48}))  # 24 a rank: 1.5 groups
    load_model(qdir, load_format="dummy", progress=False)  # whole at tp=1
    set_parallel_state(ParallelState(tp=TPGroup(0, 2)))
    with pytest.raises(ValueError, match=r"16-wide blocks; choose a --tp-size .*, or --ep-size equal to --tp-size"):
        load_model(qdir, load_format="dummy", progress=False)
    set_parallel_state(ParallelState())
    (qdir / "config.json").write_text(json.dumps(cfg | {"moe_intermediate_size": 40}))  # not whole groups at all
    with pytest.raises(ValueError, match=r"NVFP4 experts need in_features divisible by 16 .*moe_intermediate_size"):
        load_model(qdir, load_format="dummy", progress=False)
