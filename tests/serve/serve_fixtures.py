"""A small byte-level BPE tokenizer built in-process, and an HF-style dir around it.

Trained on ASCII only, so every non-ASCII character is split into single-byte tokens:
exactly the case the incremental detokenizer must get right.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "Hello there! How are you doing today? STOP here and stop there.",
    "one two three four five six seven eight nine ten",
]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_model_dir(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """An HF-style tokenizer directory (tokenizer.json + tokenizer_config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text("{}")
    return path
