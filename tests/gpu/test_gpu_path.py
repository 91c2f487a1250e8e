"""The CUDA path against the torch reference, on the same random weights (was scripts/gpu_check.py).

Each mode (bf16 KV; fp8 KV; fp8 KV with --attention-fp8-math; bf16 with the triton decode kernel
forced at every batch size through --decode-kernel) runs:

1. logits: the flashinfer backend against the torch backend, fused kernels against the unfused
   torch ops, over steps that mix fresh prefills, a prefill chunk on a cached prefix, decodes,
   and a prefill reusing another request's pages: max |diff| <= tol * max(|ref logit|, 1).
2. greedy: LocalEngine (scheduler + runner, the served Step stream) with the torch backend,
   flashinfer without CUDA graphs and flashinfer with CUDA graphs: the same greedy tokens for a
   batch with chunked prefill and a second batch served from the prefix cache. A differing token
   is accepted only at a near-tie of the reference logits (top-2 margin below the tolerance).

And once: our torch backend in float32 on the GPU against transformers' greedy generate on the
same random tiny Llama and Qwen3 checkpoints: tokens equal.

fp8 math rounds queries and probabilities to e4m3, hence its wider logits tolerance (docs/PERF.md).
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

MODELS = ("qwen3-0.6b-4L", "llama-h128", "qwen3-g8")


@dataclass(frozen=True)
class Mode:
    kv_cache_dtype: str = "auto"
    fp8_math: bool = False
    decode_kernel: str = "auto"
    tol: float = 0.03  # logits: max |diff| <= tol * max(|ref logit|, 1)


MODES = {
    "bf16": Mode(),
    "fp8kv": Mode(kv_cache_dtype="fp8_e4m3"),
    "fp8math": Mode(kv_cache_dtype="fp8_e4m3", fp8_math=True, tol=0.08),
    "bf16-triton-forced": Mode(decode_kernel="triton"),
}


@contextmanager
def unfused():  # noqa: ANN201
    """The torch reference runs every op unfused (no flashinfer norm/rope/activation kernels, no
    triton prologue or GEMVs), so the fused kernels are checked too."""
    from engine.layers import ops

    ops.set_fused(False)
    try:
        yield
    finally:
        ops.set_fused(True)


class Pages:
    def __init__(self, n: int, seed: int = 0) -> None:
        self.free = list(range(1, n))
        random.Random(seed).shuffle(self.free)

    def take(self, k: int) -> list[int]:
        out, self.free = self.free[:k], self.free[k:]
        return out


@cache
def logits_diffs(mode_name: str, path: Path) -> tuple[tuple[str, float, float, float], ...]:
    """Per step: (label, max |diff|, logit scale, argmax agreement), flashinfer vs torch. Cached:
    the greedy test derives its near-tie tolerance from the worst diff."""
    from engine.layers.attention import TorchAttention
    from engine.layers.flashinfer_attention import FlashInferAttention, set_decode_kernel
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import load_model

    mode = MODES[mode_name]
    dev = torch.device("cuda")
    model, mcfg = load_model(path, "dummy", torch.bfloat16, dev)
    ps, npages = 16, 128
    kv_dtype = torch.float8_e4m3fn if mode.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    pools = {k: KVPool(mcfg.num_layers, npages, ps, mcfg.num_kv_heads, mcfg.head_dim, kv_dtype, dev)
             for k in ("torch", "flashinfer")}
    fi = FlashInferAttention(dev)
    set_decode_kernel(fi, mode.decode_kernel)
    fi.bind(num_q_heads=mcfg.num_heads, kv_pool=pools["flashinfer"], max_batch=8, max_pages_per_req=32,
            q_dtype=torch.bfloat16, fp8_math=mode.fp8_math)
    backends = {"torch": TorchAttention(dev), "flashinfer": fi}
    g = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(3, mcfg.vocab_size - 3, (n,), generator=g).tolist()

    alloc = Pages(npages)
    a, b, c = toks(37), toks(120), toks(50)
    pa, pb, pc = alloc.take(4), alloc.take(9), alloc.take(5)
    d_new = toks(10)  # request D reuses A's first 2 full pages (32 tokens) as a cached prefix
    pd = pa[:2] + alloc.take(1)
    steps = [
        ("prefill A+B(first 100)", [(a, 0, pa), (b[:100], 0, pb)]),
        ("mixed: decode A, chunk B on prefix, prefill C", [([5], 37, pa), (b[100:], 100, pb), (c, 0, pc)]),
        ("decode A,B,C", [([6], 38, pa), ([7], 120, pb), ([8], 50, pc)]),
        ("prefill D on A's cached pages", [(d_new, 32, pd)]),
        ("decode A,B,C,D", [([9], 39, pa), ([10], 121, pb), ([11], 51, pc), ([12], 42, pd)]),
        ("decode A alone", [([13], 40, pa)]),  # batch 1: the GEMVs (with the norms split across them)
    ]
    out = []
    for label, reqs in steps:
        res = {}
        for k, be in backends.items():
            batch = ForwardBatch.from_requests(reqs, ps, dev)
            be.prepare(batch)
            if k == "torch":
                with unfused():
                    res[k] = model(batch, pools[k], be)
            else:
                res[k] = model(batch, pools[k], be)
        ref, got = res["torch"], res["flashinfer"]
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        out.append((label, (got - ref).abs().max().item(), ref.abs().max().item(), agree))
    return tuple(out)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", list(MODES))
def test_logits_match_torch(mode: str, model: str, dummy_models: dict[str, Path], flashinfer_built: None) -> None:
    tol = MODES[mode].tol
    bad = [f"{label}: max|diff| {d:.4f} > {tol * max(s, 1.0):.3f} (scale {s:.2f}, argmax agree {a:.0%})"
           for label, d, s, a in logits_diffs(mode, dummy_models[model])
           if not (math.isfinite(d) and d <= tol * max(s, 1.0))]
    assert not bad, bad


def engine_cfg(path: Path, mode: Mode, backend: str, graphs: bool, dtype: str = "bfloat16",
               load: str = "dummy"):  # noqa: ANN201
    from engine.config import ServerConfig

    half = dtype != "float32"
    return ServerConfig(
        model=str(path), load_format=load, device="cuda", dtype=dtype, attention_backend=backend,
        kv_cache_dtype=mode.kv_cache_dtype if half else "auto", attention_fp8_math=mode.fp8_math and half,
        decode_kernel=mode.decode_kernel if backend == "flashinfer" else "auto",
        disable_cuda_graph=not graphs, max_total_tokens=16384, page_size=16, max_prefill_tokens=64,
        max_running_requests=16,
    )


def seq_logits(model, mcfg, tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    """float32 logits of the last token of `tokens`: one fresh, unfused torch-backend prefill."""
    from engine.layers.attention import TorchAttention
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool

    dev = torch.device("cuda")
    ps = 16
    n = math.ceil(len(tokens) / ps)
    pool = KVPool(mcfg.num_layers, n + 1, ps, mcfg.num_kv_heads, mcfg.head_dim, model.dtype, dev)
    be = TorchAttention(dev)
    batch = ForwardBatch.from_requests([(tokens, 0, list(range(1, n + 1)))], ps, dev)
    be.prepare(batch)
    with unfused():
        return model(batch, pool, be)[0]


def token_mismatches(ref_eng, prompts, want, got, tie_tol: float) -> list[str]:  # noqa: ANN001
    """Divergences that are not near-ties of the reference logits (empty: the runs agree)."""
    bad = []
    for i, (p, w, g) in enumerate(zip(prompts, want, got, strict=True)):
        if w == g:
            continue
        j = next((k for k, (x, y) in enumerate(zip(w, g, strict=False)) if x != y), min(len(w), len(g)))
        if j >= min(len(w), len(g)):
            bad.append(f"req {i}: lengths {len(w)} vs {len(g)}")
            continue
        lg = seq_logits(ref_eng.runner.model, ref_eng.runner.mcfg, p + w[:j])
        margin = (lg[w[j]] - lg[g[j]]).item()
        if margin > tie_tol:
            bad.append(f"req {i} pos {j}: {w[j]} vs {g[j]}, margin {margin:.4f} > {tie_tol:.3f}")
    return bad


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_engine_matches_torch(mode: str, model: str, dummy_models: dict[str, Path],
                                     flashinfer_built: None) -> None:
    import json

    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    path, m = dummy_models[model], MODES[mode]
    tie_tol = max(0.05, 4 * max(d for _, d, _, _ in logits_diffs(mode, path)))
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in (5, 17, 40, 100, 33, 129)]
    # second round: extends cached prompts (prefix cache hits), 3 requests (graph padded 3 -> 4)
    prompts2 = [prompts[3][:64] + prompts[1], prompts[5] + [7, 8, 9], prompts[2][:32] + prompts[0]]
    runs, engines = {}, {}
    for label, backend, graphs in (("torch", "torch", False), ("flashinfer", "flashinfer", False),
                                   ("flashinfer+graphs", "flashinfer", True)):
        eng = LocalEngine(engine_cfg(path, m, backend, graphs))
        if backend == "torch":
            with unfused():
                r1, r2 = eng.generate(prompts, greedy), eng.generate(prompts2, greedy)
        else:
            r1, r2 = eng.generate(prompts, greedy), eng.generate(prompts2, greedy)
        runs[label] = ([r.output_ids for r in r1], [r.output_ids for r in r2], [r.cached_tokens for r in r2])
        engines[label] = eng
    graphs = engines["flashinfer+graphs"].runner.graphs
    assert graphs is not None and graphs.replays > 0, "the CUDA graphs were not used"
    if m.decode_kernel != "auto":
        assert engines["flashinfer+graphs"].runner.backend.decode_kernel(16) == m.decode_kernel
    c_ref, c_fi = runs["torch"][2], runs["flashinfer+graphs"][2]
    assert all(c > 0 for c in c_ref) and c_ref == c_fi, f"cached tokens {c_ref} (torch) vs {c_fi}"
    ref = engines["torch"]
    bad = []
    for label in ("flashinfer", "flashinfer+graphs"):
        bad += [f"{label} round 1: {b}" for b in token_mismatches(ref, prompts, runs["torch"][0], runs[label][0],
                                                                  tie_tol)]
        bad += [f"{label} round 2: {b}" for b in token_mismatches(ref, prompts2, runs["torch"][1], runs[label][1],
                                                                  tie_tol)]
    assert not bad, bad
    assert ref.core.leak_free()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_backend_fp32_matches_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=255)
    hf_cfg = (LlamaConfig(**common, bos_token_id=1, tie_word_embeddings=False, rope_theta=10000.0) if arch == "llama"
              else Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 254, (n,), generator=g).tolist() for n in (5, 17, 40, 3, 26)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).cuda().eval()
    want = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=32)
        want.append(ids[0, len(p):].tolist())
    del hf
    eng = LocalEngine(engine_cfg(tmp_path, Mode(), "torch", False, dtype="float32", load="auto"))
    got = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0,
                                                                       ignore_eos=True))]
    assert not token_mismatches(eng, prompts, want, got, 1e-4)


def test_a_long_prompt_alone_is_prefilled_in_chunks_that_sample_nothing(dummy_models: dict[str, Path],
                                                                          flashinfer_built: None) -> None:
    """A prompt 3x the prefill budget with nothing else running: its first chunks sample no row
    (flashinfer's norm on 0 rows used to crash the forward); the tokens equal a one-chunk run."""
    import dataclasses

    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    path = dummy_models["qwen3-0.6b-4L"]
    prompt = torch.randint(3, 20000, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    cfg = engine_cfg(path, MODES["bf16"], "flashinfer", True)
    chunked = LocalEngine(cfg).generate([prompt], greedy)[0].output_ids
    whole = LocalEngine(dataclasses.replace(cfg, max_prefill_tokens=256)).generate([prompt], greedy)[0].output_ids
    assert len(chunked) == 6 and chunked == whole
