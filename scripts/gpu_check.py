#!/usr/bin/env python3
"""GPU correctness check of the CUDA path (run on the GPU machine, not in CI).

Checks, each printed as PASS/FAIL with its numbers (exit status 1 if any fails):

1. logits: the flashinfer backend against the torch backend on the same dummy weights
   (bf16; Qwen3-0.6B shapes with 4 layers, and a Llama with llama3 RoPE scaling and
   head_dim 128), over steps that mix fresh prefills, a prefill chunk on a cached prefix,
   decodes, and a prefill reusing another request's pages: max |diff| within a bf16 tolerance.
2. greedy: LocalEngine (scheduler + runner, the served Step stream) with the torch backend,
   flashinfer without CUDA graphs and flashinfer with CUDA graphs: the same greedy tokens for a
   batch with chunked prefill (--max-prefill-tokens 64) and a second batch served from the
   prefix cache. A differing token is accepted only at a near-tie of the reference logits
   (top-2 margin below the tolerance), and reported.
3. transformers: our torch backend in float32 on the GPU against transformers' greedy
   generate on the same random tiny Llama and Qwen3 checkpoints: tokens equal.

flashinfer kernels are compiled first, all in one parallel ninja run (--no-precompile skips).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

RESULTS: list[dict] = []
T0 = time.perf_counter()


class unfused:  # noqa: N801 - a context manager used like a function
    """The torch reference runs every op unfused: no flashinfer norm/rope/activation kernels and
    no triton q/k-norm + RoPE + KV-store prologue, so the fused kernels are checked too."""

    def __enter__(self) -> None:
        from engine.run import ops

        ops.set_fused(False)

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        from engine.run import ops

        ops.set_fused(True)


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"[{time.perf_counter() - T0:7.1f}s] {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def run_check(name: str, fn, *args) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a crash is a FAIL with its traceback
        traceback.print_exc()
        report(name, False, f"crashed: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- setup


def precompile() -> None:
    """Build every flashinfer JIT module the engine uses, the modules in parallel.

    Each module is built in its own build dir with its own ninja (as build_and_load does), so
    the first use finds it up to date; one combined ninja run would leave no per-module build
    log, and ninja would then rebuild each module again on first use."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    t = time.perf_counter()
    bf16 = torch.bfloat16
    specs = [
        gen_batch_prefill_module("fa2", bf16, bf16, bf16, torch.int32, 128, 128, 0, False, False, False),
        gen_norm_module(), gen_act_and_mul_module("silu"), gen_rope_module(),
    ]
    todo = [s for s in specs if not s.is_aot]
    with ThreadPoolExecutor(len(todo) or 1) as pool:
        list(pool.map(lambda s: s.build(verbose=False), todo))
    print(f"flashinfer JIT: {len(todo)} of {len(specs)} modules built (not AOT) in {time.perf_counter() - t:.1f}s",
          flush=True)


def write_model(root: Path, name: str, cfg: dict) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def dummy_models(root: Path) -> dict[str, Path]:
    qwen = json.loads((REPO / "configs" / "qwen3-0.6b" / "config.json").read_text())
    qwen["num_hidden_layers"] = 4
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256, "rope_type": "llama3"},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    return {"qwen3-0.6b-4L": write_model(root, "qwen3-4l", qwen), "llama-h128": write_model(root, "llama-h128", llama)}


# ---------------------------------------------------------------- 1. logits


class Pages:
    def __init__(self, n: int, seed: int = 0) -> None:
        self.free = list(range(1, n))
        random.Random(seed).shuffle(self.free)

    def take(self, k: int) -> list[int]:
        out, self.free = self.free[:k], self.free[k:]
        return out


def check_logits(name: str, path: Path, tol_rel: float) -> float:
    from engine.run.attention import TorchAttention
    from engine.run.flashinfer_attention import FlashInferAttention
    from engine.run.forward import ForwardBatch
    from engine.run.kv_pool import KVPool
    from models.registry import load_model

    dev = torch.device("cuda")
    t = time.perf_counter()
    model, mcfg = load_model(path, "dummy", torch.bfloat16, dev)
    print(f"  {name}: dummy weights loaded in {time.perf_counter() - t:.1f}s", flush=True)
    ps, npages = 16, 128
    kv_dtype = torch.float8_e4m3fn if KV_CACHE_DTYPE == "fp8_e4m3" else torch.bfloat16
    pools = {
        k: KVPool(mcfg.num_layers, npages, ps, mcfg.num_kv_heads, mcfg.head_dim, kv_dtype, dev)
        for k in ("torch", "flashinfer")
    }
    backends = {"torch": TorchAttention(dev), "flashinfer": FlashInferAttention(dev)}
    backends["flashinfer"].bind(num_q_heads=mcfg.num_heads, kv_pool=pools["flashinfer"], max_batch=8,
                                max_pages_per_req=32, q_dtype=torch.bfloat16, fp8_math=FP8_MATH)
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
    ]
    worst = 0.0
    for label, reqs in steps:
        out = {}
        for k, be in backends.items():
            batch = ForwardBatch.from_requests(reqs, ps, dev)
            be.prepare(batch)
            if k == "torch":
                with unfused():
                    out[k] = model(batch, pools[k], be)
            else:
                out[k] = model(batch, pools[k], be)
        ref, got = out["torch"], out["flashinfer"]
        diff = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        ok = diff <= tol_rel * max(scale, 1.0) and math.isfinite(diff)
        worst = max(worst, diff)
        report(f"logits {name} [{label}]", ok,
               f"max|diff| {diff:.4f} (logit scale {scale:.2f}, tol {tol_rel * max(scale, 1.0):.3f}), "
               f"argmax agree {agree:.0%}")
    return worst


# ---------------------------------------------------------------- 2. greedy through LocalEngine


def seq_logits(model, mcfg, tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    """float32 logits of the last token of `tokens`, one fresh torch-backend prefill."""
    from engine.run.attention import TorchAttention
    from engine.run.forward import ForwardBatch
    from engine.run.kv_pool import KVPool

    dev = torch.device("cuda")
    ps = 16
    n = math.ceil(len(tokens) / ps)
    pool = KVPool(mcfg.num_layers, n + 1, ps, mcfg.num_kv_heads, mcfg.head_dim, model.dtype, dev)
    be = TorchAttention(dev)
    batch = ForwardBatch.from_requests([(tokens, 0, list(range(1, n + 1)))], ps, dev)
    be.prepare(batch)
    with unfused():
        return model(batch, pool, be)[0]


def compare_tokens(label: str, ref_eng, prompts, want, got, tie_tol: float) -> None:  # noqa: ANN001
    """PASS when equal, or when each first divergence is at a near-tie of the reference logits."""
    exact = sum(w == g for w, g in zip(want, got, strict=True))
    ties, bad = [], []
    for i, (p, w, g) in enumerate(zip(prompts, want, got, strict=True)):
        if w == g:
            continue
        j = next((k for k, (x, y) in enumerate(zip(w, g, strict=False)) if x != y), min(len(w), len(g)))
        if j >= min(len(w), len(g)):
            bad.append(f"req {i}: lengths {len(w)} vs {len(g)}")
            continue
        lg = seq_logits(ref_eng.runner.model, ref_eng.runner.mcfg, p + w[:j])
        margin = (lg[w[j]] - lg[g[j]]).item()
        (ties if margin <= tie_tol else bad).append(f"req {i} pos {j}: {w[j]} vs {g[j]}, margin {margin:.4f}")
    ok = not bad
    detail = f"{exact}/{len(want)} requests identical"
    if ties:
        detail += f"; near-ties (margin <= {tie_tol:.3f}): {ties}"
    if bad:
        detail += f"; REAL MISMATCHES: {bad}"
    report(label, ok, detail)


KV_CACHE_DTYPE = "auto"  # --kv-cache-dtype: the KV pool of the logits and greedy checks
FP8_MATH = False  # --attention-fp8-math


def engine_cfg(path: Path, backend: str, graphs: bool, dtype: str = "bfloat16", load: str = "dummy"):  # noqa: ANN201
    from engine.config import ServerConfig

    return ServerConfig(
        model=str(path), load_format=load, device="cuda", dtype=dtype, attention_backend=backend,
        kv_cache_dtype=KV_CACHE_DTYPE if dtype != "float32" else "auto",
        attention_fp8_math=FP8_MATH and dtype != "float32",
        disable_cuda_graph=not graphs, max_total_tokens=16384, page_size=16, max_prefill_tokens=64,
        max_running_requests=16,
    )


def check_greedy(name: str, path: Path, tie_tol: float) -> None:
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    lens = (5, 17, 40, 100, 33, 129)
    prompts = [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in lens]
    # second round: extends cached prompts (prefix cache hits), 3 requests (graph padded 3 -> 4)
    prompts2 = [prompts[3][:64] + prompts[1], prompts[5] + [7, 8, 9], prompts[2][:32] + prompts[0]]
    from engine.env import env

    print(f"  decode kernel {env().decode_kernel}, fused prologue {env().fused_prologue}", flush=True)
    runs = {}
    engines = {}
    for label, backend, graphs in (("torch", "torch", False), ("flashinfer", "flashinfer", False),
                                   ("flashinfer+graphs", "flashinfer", True)):
        t = time.perf_counter()
        eng = LocalEngine(engine_cfg(path, backend, graphs))
        t_init = time.perf_counter() - t
        if backend == "torch":
            with unfused():
                r1, r2 = eng.generate(prompts, greedy), eng.generate(prompts2, greedy)
        else:
            r1, r2 = eng.generate(prompts, greedy), eng.generate(prompts2, greedy)
        cached = [r.cached_tokens for r in r2]
        replays = getattr(eng.runner.graphs, "replays", None)
        print(f"  {name} {label}: init {t_init:.1f}s, run {time.perf_counter() - t - t_init:.1f}s, "
              f"cached tokens round 2 {cached}, graph replays {replays}", flush=True)
        runs[label] = ([r.output_ids for r in r1], [r.output_ids for r in r2], cached)
        engines[label] = eng
        if label == "flashinfer+graphs":
            report(f"graphs used {name}", bool(replays), f"{replays} decode replays, sizes {eng.runner.graphs.sizes}")
    ref = engines["torch"]
    c_ref, c_fi = runs["torch"][2], runs["flashinfer+graphs"][2]
    report(f"prefix cache {name}", all(c > 0 for c in c_ref) and c_ref == c_fi,
           f"cached tokens per request {c_ref} (torch) vs {c_fi} (flashinfer+graphs)")
    for label in ("flashinfer", "flashinfer+graphs"):
        compare_tokens(f"greedy {name} {label} vs torch (round 1: chunked prefill)", ref, prompts,
                       runs["torch"][0], runs[label][0], tie_tol)
        compare_tokens(f"greedy {name} {label} vs torch (round 2: cached prefixes)", ref, prompts2,
                       runs["torch"][1], runs[label][1], tie_tol)
    assert engines["torch"].core.leak_free()


# ---------------------------------------------------------------- 3. transformers (fp32)


def check_transformers(root: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    cfgs = {
        "tiny-llama": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  eos_token_id=255, bos_token_id=1, tie_word_embeddings=False, rope_theta=10000.0),
        "tiny-qwen3": Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=512, eos_token_id=255, tie_word_embeddings=True,
                                  rope_theta=1000000.0),
    }
    for name, hf_cfg in cfgs.items():
        path = root / f"hf-{name}"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(path)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(2, 254, (n,), generator=g).tolist() for n in (5, 17, 40, 3, 26)]
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
        want = []
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0, min_new_tokens=32)
            want.append(ids[0, len(p):].tolist())
        del hf
        eng = LocalEngine(engine_cfg(path, "torch", False, dtype="float32", load="auto"))
        got = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0,
                                                                           ignore_eos=True))]
        compare_tokens(f"transformers fp32 GPU greedy == ours (torch backend) {name}", eng, prompts, want, got, 1e-4)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--tol", type=float, default=0.03, help="logits: max |diff| <= tol * max(|ref logit|, 1)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["logits", "greedy", "transformers"])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV pool of the checks (auto | fp8_e4m3)")
    ap.add_argument("--attention-fp8-math", action="store_true", help="fp8 KV attended in fp8 math (XQA GMMA)")
    args = ap.parse_args()
    global KV_CACHE_DTYPE, FP8_MATH
    KV_CACHE_DTYPE, FP8_MATH = args.kv_cache_dtype, args.attention_fp8_math
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 2
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if not args.no_precompile:
        precompile()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = dummy_models(root)
        worst = {}
        if "logits" not in args.skip:
            for name, path in models.items():
                worst[name] = 0.0
                run_check(f"logits {name}", lambda n=name, p=path: worst.__setitem__(n, check_logits(n, p, args.tol)))
        if "greedy" not in args.skip:
            for name, path in models.items():
                tie_tol = max(0.05, 4 * worst.get(name, 0.0))
                run_check(f"greedy {name}", check_greedy, name, path, tie_tol)
        if "transformers" not in args.skip:
            run_check("transformers", check_transformers, root)
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {time.perf_counter() - T0:.0f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": RESULTS, "device": torch.cuda.get_device_name()}, indent=1))
    return 1 if failed or not RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
