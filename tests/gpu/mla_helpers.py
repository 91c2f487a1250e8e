"""Shared by the MLA decode GPU tests (test_mla_gpu.py, test_mla_flashinfer_gpu.py,
test_flash_mla_gpu.py): a tiny DeepSeek-V3 on disk, an MLABackend bound to a pool, a V3-shaped
step over one latent layer, a tiny model's pool prefilled for a decode step, and the checks that
compare kernels (logits close; greedy tokens equal but at transformers' near ties)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

CUDA = torch.device("cuda")
BF = torch.bfloat16
R, P = 512, 64  # DeepSeek-V3's kv_lora_rank and rope dims


def tiny_v3(heads: int) -> dict:
    """A DeepSeek-V3 config with `heads` query heads and V3's latent (512 + 64, YaRN scale), all
    dense (no MoE routing flips between kernels)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
        "intermediate_size": 384, "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 2,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": 96, "kv_lora_rank": R,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": P, "v_head_dim": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }


def save_tiny(config: dict, path: Path) -> Path:
    """Random float32 weights for `config` (norms near 1, the rest N(0, 0.1)) saved at `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def mla_backend(heads: int, kv, max_batch: int = 16, max_pages: int = 2048):  # noqa: ANN001, ANN201
    """An MLABackend bound to `kv` for `heads` query heads (bf16 queries): the tuning picks its kernel."""
    from engine.layers.mla_attention import MLABackend

    b = MLABackend(CUDA)
    b.bind(num_q_heads=heads, kv_pool=kv, max_batch=max_batch, max_pages_per_req=max_pages, q_dtype=BF)
    return b


def v3_step(lens: list[int], extend: list[int], ps: int, heads: int = 128):  # noqa: ANN201
    """(kv, batch, (q_nope, q_pe), w_kv_b, shapes) of one V3-shaped step over one random latent
    layer: requests of KV lengths `lens` with `extend` new tokens each, on shuffled pages."""
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.mla_attention import MLAShapes

    pages = sum(-(-n // ps) for n in lens) + 2
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, pages, ps, BF, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    kv.latent[0].copy_(torch.randn(kv.latent[0].shape, generator=g, device=CUDA).to(BF))
    free = list(range(1, pages))
    random.Random(1).shuffle(free)
    reqs = [([1] * e, n - e, [free.pop() for _ in range(-(-n // ps))]) for n, e in zip(lens, extend, strict=True)]
    batch = ForwardBatch.from_requests(reqs, ps, CUDA)
    t, nope, v = batch.num_tokens, 128, 128
    q_nope = torch.randn(t, heads, nope, generator=g, device=CUDA).to(BF)
    q_pe = torch.randn(t, heads, P, generator=g, device=CUDA).to(BF)
    w = (torch.randn(heads * (nope + v), R, generator=g, device=CUDA) * R**-0.5).to(BF)
    return kv, batch, (q_nope, q_pe), w, MLAShapes(heads, R, nope, P, v, (nope + P) ** -0.5 * 1.3)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: max |got - want| over max |want|."""
    return (got.float() - want.float()).abs().amax(dim=(1, 2)) / want.float().abs().amax(dim=(1, 2))


def prefilled(path: Path, lens: list[int], ps: int, pages: int, kv_dtype: torch.dtype = BF):  # noqa: ANN201
    """(model, kv, tables, step, prompts): the tiny model in bf16, a pool of `pages` pages holding
    `lens` random prompt tokens each on shuffled pages, and the next decode step of every request."""
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import kv_layout, load_model

    model, cfg = load_model(path, dtype=BF, device=CUDA, progress=False)
    kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, pages, ps, kv_dtype, CUDA)
    free = list(range(1, pages))
    random.Random(4).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + 1) // ps))] for n in lens]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    model(ForwardBatch.from_requests([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], ps, CUDA), kv)
    step = ForwardBatch.from_requests([([7 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables, strict=True))],
                                      ps, CUDA)
    return model, kv, tables, step, prompts


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits within 5% of a row's largest, and the argmax the same in >= 60% of rows (bf16 near ties)."""
    scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1)
    assert ((got - want).abs() / scale).amax() < 0.05
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.6


def near_tie_failures(path: Path, prompts: list[list[int]], want: list[list[int]],
                      runs: dict[str, list[list[int]]], tie: float) -> list[str]:
    """Where a run's greedy tokens first leave `want`: those where transformers' float32 logits of
    the two tokens differ by more than `tie` (a real disagreement, not a near tie)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    bad = []
    for name, outs in runs.items():
        for i, (p, w, o) in enumerate(zip(prompts, want, outs, strict=True)):
            j = next((k for k, (x, y) in enumerate(zip(w, o, strict=True)) if x != y), None)
            if j is None:
                continue
            with torch.inference_mode():
                row = hf(torch.tensor([p + w[:j]], device="cuda")).logits[0, -1].float()
            if abs(row[w[j]] - row[o[j]]).item() > tie:
                bad.append(f"{name} prompt {i} position {j}: {w[j]} vs {o[j]}")
    return bad


def served_greedy(path: Path, prompts: list[list[int]], graphs: bool, page_size: int, max_prefill_tokens: int,
                  **tuning: object) -> tuple[str, int, int, list[list[int]]]:
    """(page size, MLA decode kernel, graph replays, 24 greedy tokens a prompt) of the served path
    (LocalEngine: scheduler + runner, chunked prefill beside decode rows, overlap) on bf16 with
    these tuning fields over the GPU's file (override_tuning; `page_size` 0: the auto size)."""
    from engine.config import ServerConfig
    from engine.layers.tuning import override_tuning
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    override_tuning(**tuning)
    cfg = ServerConfig(model=str(path), load_format="auto", device="cuda", dtype="bfloat16", page_size=page_size,
                       max_total_tokens=8192, max_prefill_tokens=max_prefill_tokens, max_running_requests=8,
                       disable_cuda_graph=not graphs, grammar_helpers=0)
    eng = LocalEngine(cfg)
    kernel = eng.runner.backend.kernel
    out = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0,
                                                                       ignore_eos=True))]
    replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    assert eng.core.leak_free()
    del eng
    torch.cuda.empty_cache()
    return cfg.page_size, kernel, replays, out
