"""EAGLE / EAGLE-3 heads written in the HF format (safetensors + config.json) for a Llama target,
random unless the caller gives tensors (tests/engine/test_spec_eagle.py, tests/models/test_draft_heads.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer(prefix: str, h: int, heads: int, kv: int, d: int, inter: int, qkv_in: int, g: torch.Generator,
           std: float, input_norm: bool = True, hidden_norm: bool = False) -> dict[str, torch.Tensor]:
    """A Llama layer's tensors as HF names them (separate q/k/v, gate/up)."""
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    a = f"{prefix}.self_attn"
    t = {f"{a}.q_proj.weight": w(heads * d, qkv_in), f"{a}.k_proj.weight": w(kv * d, qkv_in),
         f"{a}.v_proj.weight": w(kv * d, qkv_in), f"{a}.o_proj.weight": w(h, heads * d),
         f"{prefix}.mlp.gate_proj.weight": w(inter, h), f"{prefix}.mlp.up_proj.weight": w(inter, h),
         f"{prefix}.mlp.down_proj.weight": w(h, inter), f"{prefix}.post_attention_layernorm.weight": 1 + w(h)}
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = 1 + w(h)
    if hidden_norm:
        t[f"{prefix}.hidden_norm.weight"] = 1 + w(h)
    return t


def write_head(path: Path, target: dict, kind: str, seed: int = 0, std: float = 0.05, draft_vocab: int = 0,
               inter: int = 128, layers: int = 1, tensors: dict[str, torch.Tensor] | None = None,
               **extra: object) -> Path:
    """A random head of `kind` for `target` (its config.json dict) in `path`; `tensors` replace
    (or add to) the random ones; `extra` goes into config.json."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = target["hidden_size"], target["num_attention_heads"], target.get("num_key_value_heads")
    kv = kv or heads
    d = target.get("head_dim") or h // heads
    vocab = target["vocab_size"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if kind == "EAGLE3" else "LlamaForCausalLMEagle"],
           "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": d, "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", **extra}
    if kind == "EAGLE3":
        t = _layer("midlayer", h, heads, kv, d, inter, 2 * h, g, std, hidden_norm=True)
        t["fc.weight"] = torch.randn(h, 3 * h, generator=g) * std
        t["norm.weight"] = 1 + torch.randn(h, generator=g) * std
        if draft_vocab:
            cfg["draft_vocab_size"] = draft_vocab
            hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
            t["d2t"] = hot - torch.arange(draft_vocab)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[hot] = True
            t["t2d"] = t2d
            t["lm_head.weight"] = torch.randn(draft_vocab, h, generator=g) * std
    else:
        t = {}
        for i in range(layers):  # layer 0 has no input norm (EAGLE's)
            t |= _layer(f"layers.{i}", h, heads, kv, d, inter, h, g, std, input_norm=i > 0)
        t["fc.weight"] = torch.randn(h, 2 * h, generator=g) * std
        t["fc.bias"] = torch.randn(h, generator=g) * std
    t |= tensors or {}
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path
