"""Write a plain HF checkpoint into a quantized on-disk format, with the real config keys; and
dequantize a quantized checkpoint back to float32 (the reference the engine is compared to).

    python -m scripts.quantize_checkpoint SRC DST --format fp8-block
    python -m scripts.quantize_checkpoint DST REF --dequantize

Formats (what production checkpoints ship; models/quant.py reads them):
  fp8-block       config.json quant_method fp8, weight_block_size [128, 128], weight_scale_inv
                  (DeepSeek-V3/R1, Qwen3-*-FP8)
  ct-channel      compressed-tensors float-quantized, per-channel weight_scale [N, 1] (bf16),
                  dynamic per-token activations (llm-compressor's FP8-dynamic)
  ct-tensor       compressed-tensors, per-tensor weight_scale and a static input_scale
  modelopt-fp8    hf_quant_config.json quant_algo FP8: per-tensor scalar weight_scale and
                  input_scale, k_scale / v_scale on k_proj / v_proj
  modelopt-nvfp4  hf_quant_config.json and config.json quant_algo NVFP4: uint8 pairs of e2m1
                  codes (even column low), e4m3 weight_scale per 16, scalar weight_scale_2
                  (each routed expert's gate/up/down its own); an MLA model's attention stays
                  as it is, `model.layers.*.self_attn*` in exclude_modules (ModelOpt's wildcards;
                  q_lora_rank need not be a multiple of 16, and the engine keeps kv_b_proj plain)

Only the decoder's projections are quantized (q/k/v/o, gate/up/down, of the dense MLP, the
shared experts and every routed expert: `mlp.experts.{e}.gate_proj` etc.); embeddings, norms,
the LM head and an MoE router (`mlp.gate`, listed in the ignore list as real checkpoints do)
stay as they are, as every format above leaves them. This module's arithmetic is
its own (it does not import the engine), so a test that compares the engine on DST with the
engine on the dequantized copy checks the engine's reading of each format.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8-block", "ct-channel", "ct-tensor", "modelopt-fp8", "modelopt-nvfp4")
# attention's (MLA's q_a/q_b/kv_a_proj_with_mqa/kv_b_proj too, as DeepSeek's fp8 checkpoints
# store them); the dense MLP's, the shared experts' and every routed expert's gate/up/down; an
# MoE layer's router (mlp.gate) stays as it is, as every format's MoE checkpoints keep it
_PROJ = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
F8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _f8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(F8)


def _block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    s = torch.empty(-(-n // 128), -(-k // 128))
    q = torch.empty(n, k, dtype=F8)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = _f8(blk / s[i, j])
    return {"weight": q, "weight_scale_inv": s}


def _channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    s = (w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0).to(torch.bfloat16)  # stored bf16, as shipped
    return {"weight": _f8(w / s.float()), "weight_scale": s}


def _tensor(w: torch.Tensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    s = w.abs().max().clamp(min=1e-12) / 448.0
    return {"weight": _f8(w / s), "weight_scale": s.reshape(shape), "input_scale": torch.full(shape, 0.02)}


def _nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // 16, 16)
    gmax = g.abs().amax(2)
    s2 = w.abs().max().clamp(min=1e-12) / (6.0 * 448.0)  # one global scale per tensor
    gs = _f8(gmax / 6.0 / s2)
    unit = (gs.float() * s2).clamp(min=1e-30)[:, :, None]
    mag = (g.abs() / unit).reshape(n, k, 1)
    codes = (mag - E2M1).abs().argmin(-1) + 8 * (w < 0).long()
    codes = codes.to(torch.uint8)
    return {"weight": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_scale": gs, "weight_scale_2": s2,
            "input_scale": torch.tensor(0.02)}


def _quantize(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    w = w.float()
    if fmt == "fp8-block":
        return _block(w)
    if fmt == "ct-channel":
        return _channel(w)
    if fmt == "ct-tensor":
        return _tensor(w, (1,))
    if fmt == "modelopt-fp8":
        out = _tensor(w, ())
        if name.endswith("k_proj.weight"):
            out["k_scale"] = torch.tensor(1.0)
        if name.endswith("v_proj.weight"):
            out["v_scale"] = torch.tensor(1.0)
        return out
    return _nvfp4(w)


def _config_keys(fmt: str, exclude: list[str]) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) for a format; `exclude`: modules
    left unquantized besides the LM head (ModelOpt's exclude_modules)."""
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"]}, None
    if fmt.startswith("ct-"):
        channel = fmt == "ct-channel"
        group = {"targets": ["Linear"], "output_activations": None,
                 "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                             "strategy": "channel" if channel else "tensor", "group_size": None,
                             "block_structure": None, "observer": "minmax"},
                 "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": channel,
                                       "strategy": "token" if channel else "tensor"}}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": group}, "kv_cache_scheme": None,
                "quantization_status": "compressed"}, None
    algo = "FP8" if fmt == "modelopt-fp8" else "NVFP4"
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                 "exclude_modules": ["lm_head", *exclude],
                                 **({"group_size": 16} if algo == "NVFP4" else {})}}
    in_config = {"quant_method": "modelopt", "quant_algo": algo, **({"group_size": 16} if algo == "NVFP4" else {})}
    return (in_config if algo == "NVFP4" else None), hf_quant


def _excluded(cfg: dict, fmt: str) -> list[str]:
    """Module wildcards that `fmt` leaves unquantized in the model of config.json `cfg`: for NVFP4,
    an MLA model's attention."""
    return ["model.layers.*.self_attn*"] if fmt == "modelopt-nvfp4" and "kv_lora_rank" in cfg else []


def quantize_dir(src: Path, dst: Path, fmt: str) -> Path:
    """Copy the checkpoint in `src` to `dst` with its projections in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    exclude = _excluded(cfg, fmt)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if _PROJ.match(name) and not any(fnmatchcase(name, e) for e in exclude):
                base = name[: -len("weight")]
                out.update({base + k: v.contiguous() for k, v in _quantize(name, t, fmt).items()})
            else:
                out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    in_config, hf_quant = _config_keys(fmt, exclude)
    if in_config is not None:
        cfg["quantization_config"] = in_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=1))
    return dst


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    table = torch.cat([E2M1, -E2M1])
    lo, hi = table[(packed & 15).long()], table[(packed >> 4).long()]
    return torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)


def dequantize_dir(src: Path, dst: Path) -> Path:
    """Write the float32 checkpoint that the quantized one in `src` stands for (scales applied)."""
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base = name[: -len("weight")] if name.endswith(".weight") else None
        stored_plain = t.is_floating_point() and t.dtype != F8  # a projection the format left as it was
        if base is None or not _PROJ.match(name) or stored_plain:
            if not re.search(r"\.(weight_scale(_inv|_2)?|input_scale|[kv]_scale)$", name):
                out[name] = t.float() if t.is_floating_point() else t
            continue
        if t.dtype == torch.uint8:  # nvfp4
            gs = tensors[base + "weight_scale"].float().repeat_interleave(16, 1)
            out[name] = _unpack(t) * gs * tensors[base + "weight_scale_2"].float()
        elif base + "weight_scale_inv" in tensors:
            s = tensors[base + "weight_scale_inv"].float()
            n, k = t.shape
            out[name] = t.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        else:
            s = tensors[base + "weight_scale"].float()
            out[name] = t.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json" and f.name != "hf_quant_config.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--format", choices=FORMATS)
    group.add_argument("--dequantize", action="store_true", help="write the float32 checkpoint SRC stands for")
    a = ap.parse_args()
    path = dequantize_dir(a.src, a.dst) if a.dequantize else quantize_dir(a.src, a.dst, a.format)
    print(path)


if __name__ == "__main__":
    main()
