"""`--model` as a Hugging Face hub id, resolved offline from a cache laid out as the hub lays it
out (models--Org--Name/refs/main, snapshots/<commit>/ linked into blobs/). huggingface_hub
reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import, so each case runs in a fresh interpreter
with that environment: the same path `bin/serve` takes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.hub import is_hub_id
from models.registry import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-llama"
HUB_ID = "strata-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A hub cache holding `files` as refs/main's snapshot (each a symlink to its blob)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)  # no newline, as the hub writes it
    (repo / "blobs").mkdir()
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return root


def run_offline(cache: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_hub_id_from_offline_cache_loads_like_the_directory(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path / "hub", HUB_ID, {"config.json": (TINY / "config.json").read_bytes()})
    code = ("from engine.config import ServerConfig; from engine.bench.workload import resolve_model_dir; "
            f"print(resolve_model_dir({HUB_ID!r})); "
            f"print(ServerConfig(model={HUB_ID!r}, load_format='dummy', device='cpu').to_json())")
    res = run_offline(cache, code)
    assert res.returncode == 0, res.stderr
    bench_dir, cfg_json = res.stdout.strip().splitlines()[-2:]
    cfg = ServerConfig.from_json(cfg_json)  # a child's view: a directory
    snap = cache / "models--strata-test--tiny-llama" / "snapshots" / COMMIT
    assert Path(bench_dir) == snap  # bin/bench reads the same snapshot's config
    assert Path(cfg.model) == snap and cfg.model_name == HUB_ID
    assert (Path(cfg.model) / "config.json").read_bytes() == (TINY / "config.json").read_bytes()
    # the same dummy model as from configs/tiny-llama (dummy weights depend on config and seed only)
    a, _ = load_model(cfg.model, load_format="dummy", dtype=torch.float32)
    b, _ = load_model(TINY, load_format="dummy", dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 0
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path / "hub", HUB_ID, {"config.json": (TINY / "config.json").read_bytes()})
    res = run_offline(cache, "from engine.args import parse_args; parse_args(['--model', 'nobody/no-such-model'])")
    assert res.returncode == 2, res.stderr  # bin/serve's bad-argument exit, before any process starts
    assert "--model nobody/no-such-model" in res.stderr and str(cache) in res.stderr
    # a cached snapshot without weights does not serve --load-format auto offline either
    res = run_offline(cache, f"from engine.args import parse_args; parse_args(['--model', {HUB_ID!r}])")
    assert res.returncode == 2 and f"--model {HUB_ID}" in res.stderr and str(cache) in res.stderr


def test_directory_wins_and_paths_are_not_ids(tmp_path: Path) -> None:
    cfg = ServerConfig(model=str(TINY), load_format="dummy")
    assert cfg.model == str(TINY) and cfg.model_name == "tiny-llama"  # unchanged: no hub involved
    assert is_hub_id("Qwen/Qwen3-30B-A3B") and is_hub_id("gpt2")
    for path in ("/abs/dir", "./rel", "~/m", "a/b/c", "../x", "Org/.."):
        assert not is_hub_id(path)
    with pytest.raises(ValueError, match="--model /no/such/dir: no such directory"):
        ServerConfig(model="/no/such/dir")
