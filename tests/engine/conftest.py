"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocabulary 256) saved as transformers saves it."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=255, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path
