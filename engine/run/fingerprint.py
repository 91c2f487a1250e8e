"""The model fingerprint a worker reports for the L3 disk tier (it knows the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.cache.l3 import model_fingerprint
from models.loader import weights_identity


def worker_fingerprint(
    cfg: Any, dtype: Any, kv_dtype: Any, page_bytes: int, num_layers: int, kv_layout: str = ""
) -> bytes:
    """config.json, the weights' identity (models/loader.py), dtypes and layout (the page's
    bytes and layers, and the model's declared KV layout: `KVLayout.describe`)."""
    config = Path(cfg.model, "config.json").read_bytes()
    weights = weights_identity(cfg.model, cfg.load_format) + b"\0quantization:" + cfg.quantization.encode()
    return model_fingerprint(config, weights, str(dtype), str(kv_dtype), cfg.page_size, cfg.tp_size,
                             page_bytes, num_layers, kv_layout)
