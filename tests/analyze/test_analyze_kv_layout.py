"""bin/analyze names each worker's KV pool and the layout its model declares (the runner's
`kv pool` start-up line, its `layout` field written by KVLayout.describe), with the bytes a
token costs in one layer: K and V for GQA, one latent for MLA."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from engine.analyze import analyze, print_text
from engine.layers.kv_layout import KVLayout


def _kv_pool_line(layout: KVLayout, dtype: torch.dtype, at: str) -> str:
    return json.dumps({"event": "kv pool: 4096 tokens, 0.28 GiB on cuda", "layout": layout.describe(dtype),
                       "sized_by": "--max-total-tokens", "proc": "worker", "level": "info", "timestamp": at})


def test_kv_pool_layouts(tmp_path: Path) -> None:
    (tmp_path / "worker-0.log").write_text(
        _kv_pool_line(KVLayout.latent(512, 64), torch.bfloat16, "2026-01-01T00:00:00.000000Z") + "\n")
    (tmp_path / "worker-1.log").write_text(
        _kv_pool_line(KVLayout.gqa(8, 128), torch.float8_e4m3fn, "2026-01-01T00:00:00.100000Z") + "\n")
    rep = analyze(tmp_path)
    assert rep.kv_pools["worker-0"] == {"pool": "4096 tokens, 0.28 GiB on cuda",
                                        "layout": "latent:1x576:bfloat16", "token_layer_bytes": 1152}
    assert rep.kv_pools["worker-1"]["token_layer_bytes"] == 2 * 8 * 128
    buf = io.StringIO()
    print_text(rep, out=buf)
    want = "kv pool (worker-0): 4096 tokens, 0.28 GiB on cuda; layout latent:1x576:bfloat16, 1152 bytes"
    assert want in buf.getvalue()
