"""Fixtures for the serve tests (see serve_fixtures.py for the tokenizer they use)."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_fixtures import build_tokenizer, write_model_dir
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def small_tok() -> Tokenizer:
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def text_tok(model_dir: Path):  # noqa: ANN201 - engine.tokenizer.TextTokenizer
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    assert tok is not None
    return tok
