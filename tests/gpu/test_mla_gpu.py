"""MLA on CUDA: the triton decode kernel (engine/layers/mla_kernels.py) at DeepSeek-V3's shapes
(128 heads, latent 512 + 64) against the torch absorbed path, batch invariance of the compiled
kernel, a tiny DeepSeek-V3's decode logits kernel vs torch (bf16 and fp8 latent pool), and the
served tiny DeepSeek-V3 in float32 against transformers' greedy tokens."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

CUDA = torch.device("cuda")
V3 = dict(heads=128, r=512, p=64, nope=128, v=128)
FP8 = torch.float8_e4m3fn


def _decode_batch(lens: list[int], page_size: int, pages: int, seed: int):  # noqa: ANN202
    from engine.layers.forward import ForwardBatch

    free = list(range(1, pages))
    random.Random(seed).shuffle(free)  # non-contiguous page tables
    reqs = [([1], n - 1, [free.pop() for _ in range(-(-n // page_size))]) for n in lens]
    return ForwardBatch.from_requests(reqs, page_size, CUDA)


def _v3_attend(lens: list[int], kv_dtype: torch.dtype, page_size: int, kernel: bool) -> torch.Tensor:
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.mla_attention import MLAPlan, MLAShapes, mla_attend

    h, r, p, nope, v = V3["heads"], V3["r"], V3["p"], V3["nope"], V3["v"]
    pages = sum(-(-n // page_size) for n in lens) + 2
    kv = KVPool.from_layout(KVLayout.latent(r, p), 1, pages, page_size, kv_dtype, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    kv.latent[0].copy_(torch.randn(kv.latent[0].shape, generator=g, device=CUDA).to(kv_dtype))
    batch = _decode_batch(lens, page_size, pages, seed=1)
    bf = torch.bfloat16
    q_nope = torch.randn(len(lens), h, nope, generator=g, device=CUDA).to(bf)
    q_pe = torch.randn(len(lens), h, p, generator=g, device=CUDA).to(bf)
    w = (torch.randn(h * (nope + v), r, generator=g, device=CUDA) * r**-0.5).to(bf)
    s = MLAShapes(h, r, nope, p, v, (nope + p) ** -0.5)
    return mla_attend(q_nope, q_pe, MLAPlan.build(batch, kernel=kernel), kv, 0, w, s)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_kernel_matches_torch_at_v3_shapes(kv_dtype: torch.dtype, page_size: int) -> None:
    """Uneven lengths (1, within a page, past several splits, 16k+), shuffled pages."""
    lens = [1, 15, 1000, 4097, 16500, 777]
    want = _v3_attend(lens, kv_dtype, page_size, kernel=False)
    got = _v3_attend(lens, kv_dtype, page_size, kernel=True)
    assert got.shape == want.shape == (len(lens), V3["heads"], V3["v"])
    err = (got.float() - want.float()).abs().amax(dim=(1, 2)) / want.float().abs().amax(dim=(1, 2))
    assert (err < 0.02).all(), err.tolist()  # bf16 rounding of q_lat, probabilities and the output


def test_kernel_rows_are_batch_invariant() -> None:
    from engine.layers import mla_kernels

    h, r, p, ps = V3["heads"], V3["r"], V3["p"], 64
    lens = [5000, 3, 1200, 64, 9000]
    pages = sum(-(-n // ps) for n in lens) + 2
    g = torch.Generator(device=CUDA).manual_seed(2)
    lat = torch.randn(pages * ps, 1, r + p, generator=g, device=CUDA).to(torch.bfloat16)
    batch = _decode_batch(lens, ps, pages, seed=3)
    q_lat = torch.randn(len(lens), h, r, generator=g, device=CUDA).to(torch.bfloat16)
    q_pe = torch.randn(len(lens), h, p, generator=g, device=CUDA).to(torch.bfloat16)
    full = mla_kernels.mla_decode(q_lat, q_pe, lat, batch.page_table, batch.seq_lens, 0.07, ps)
    wide = mla_kernels.default_config(h)
    limit = torch.cuda.get_device_properties(CUDA).shared_memory_per_block_optin
    fits = [v for v in (1, 2, 4) if wide.shared_bytes(r, p, 2, v_split=v) <= limit]
    assert len(fits) >= 2 and 1 in fits  # (v_split 2 of the 3-stage wide tile is 1 KB too big on an H200)
    for v in fits:  # the batch size picks the column split (4 here): the bits do not move with it
        cfg = replace(wide, v_split=v)
        assert torch.equal(mla_kernels.mla_decode(q_lat, q_pe, lat, batch.page_table, batch.seq_lens, 0.07, ps,
                                                  cfg), full), f"v_split {v}"
    for i in range(len(lens)):
        # fresh tensors, as a step's batch has (a slice's offset would change triton's alignment
        # specialization: another compiled variant, not another batch)
        one = mla_kernels.mla_decode(q_lat[i : i + 1].clone(), q_pe[i : i + 1].clone(), lat,
                                     batch.page_table[i : i + 1].clone(), batch.seq_lens[i : i + 1].clone(), 0.07, ps)
        assert torch.equal(one[0], full[i]), f"row {i}"


def test_every_swept_tile_config_gives_the_default_output() -> None:
    """The configs bin/bench mla --sweep times compile and agree (any may become the default;
    bf16: the fp8 pool differs only in its load, checked above)."""
    from engine.bench.mla import sweep_configs
    from engine.layers import mla_kernels

    h, r, p, ps = V3["heads"], V3["r"], V3["p"], 16
    lens = [3000, 17, 1100]
    pages = sum(-(-n // ps) for n in lens) + 2
    g = torch.Generator(device=CUDA).manual_seed(6)
    lat = torch.randn(pages * ps, 1, r + p, generator=g, device=CUDA).to(torch.bfloat16)
    batch = _decode_batch(lens, ps, pages, seed=7)
    q_lat = torch.randn(len(lens), h, r, generator=g, device=CUDA).to(torch.bfloat16)
    q_pe = torch.randn(len(lens), h, p, generator=g, device=CUDA).to(torch.bfloat16)
    want = mla_kernels.mla_decode(q_lat, q_pe, lat, batch.page_table, batch.seq_lens, 0.07, ps).float()
    for c in sweep_configs():
        got = mla_kernels.mla_decode(q_lat, q_pe, lat, batch.page_table, batch.seq_lens, 0.07, ps,
                                     mla_kernels.MLAKernelConfig(*c)).float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), c


@pytest.mark.parametrize(("r", "p", "dtype"),
                         [(32, 8, torch.float32), (32, 8, torch.bfloat16), (24, 12, torch.float32)],
                         ids=["tiny-v3-fp32", "tiny-v3-bf16", "not-pow2"])
def test_latent_dims_below_16_compile_and_match(r: int, p: int, dtype: torch.dtype) -> None:
    """The tiny DeepSeek-V3 of tests/models (32 + 8: tl.dot's K >= 16 failed to compile on the
    first H200 run) and dims that are not powers of two: padded, masked, against float32."""
    from engine.layers import mla_kernels

    ps, lens, h = 16, [3, 40, 700, 17], 4
    pages = sum(-(-n // ps) for n in lens) + 2
    g = torch.Generator(device=CUDA).manual_seed(11)
    lat = torch.randn(pages * ps, 1, r + p, generator=g, device=CUDA).to(dtype)
    batch = _decode_batch(lens, ps, pages, seed=12)
    q_lat = torch.randn(len(lens), h, r, generator=g, device=CUDA).to(dtype)
    q_pe = torch.randn(len(lens), h, p, generator=g, device=CUDA).to(dtype)
    got = mla_kernels.mla_decode(q_lat, q_pe, lat, batch.page_table, batch.seq_lens, 0.3, ps).float()
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=CUDA)
        kv = lat[batch.page_table[i, pos // ps].long() * ps + pos % ps, 0].float()
        probs = (torch.cat([q_lat[i], q_pe[i]], -1).float() @ kv.T * 0.3).softmax(-1)
        want = probs @ kv[:, :r]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got[i] - want).abs().max() <= tol * max(1.0, want.abs().max().item()), (i, n)


def test_bench_point_batch_8_in_a_cuda_graph() -> None:
    """bin/bench mla's point that died with an illegal memory access on the first H200 run (128
    heads, bf16, batch 8, context 1024, 61 layers' pools): the kernel's rows against float32, then
    captured in a CUDA graph on a side stream (as do_bench_cudagraph does) and replayed: the same
    output."""
    from engine.bench.mla import _Point

    pt = _Point(128, torch.bfloat16, 8, 1024, 16, CUDA)
    run = pt.ours()
    torch.cuda.synchronize()  # the point's setup ran on the default stream
    eager = run()
    assert pt.error(eager) < 0.02
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


TINY = {  # a DeepSeek-V3 whose latent dims the compiled kernel takes (tl.dot: dims >= 16)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
    "intermediate_size": 192, "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 48, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 9,
    "num_experts_per_tok": 3, "n_group": 3, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "vocab_size": 256, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
}


def _checkpoint(path: Path, config: dict) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dense layer, then an MoE layer."""
    return _checkpoint(tmp_path_factory.mktemp("tiny-v3"), TINY)


@pytest.fixture(scope="module")
def tiny_v3_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All dense: no MoE block, so its decode is captured in CUDA graphs."""
    return _checkpoint(tmp_path_factory.mktemp("tiny-v3-dense"), {**TINY, "first_k_dense_replace": 2})


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_tiny_v3_decode_logits_kernel_vs_torch(tiny_v3_dense: Path, kv_dtype: torch.dtype) -> None:
    """bf16 model (all dense: an MoE router flips experts at bf16 near-ties, which says nothing
    about attention): prefill four prompts, then one decode step with the kernel and with the
    torch path over the same pool: logits close."""
    from engine.layers import ops

    ops.set_fused(False)  # torch norms and activations: no flashinfer JIT for this test
    try:
        _kernel_vs_torch(tiny_v3_dense, kv_dtype)
    finally:
        ops.set_fused(True)


def _kernel_vs_torch(tiny_v3: Path, kv_dtype: torch.dtype) -> None:
    from tests.gpu.mla_helpers import prefilled

    model, kv, _, step, _ = prefilled(tiny_v3, [5, 40, 300, 129], 16, 64, kv_dtype)
    out = {}
    for kernel in (False, True):
        model.decode_kernel = kernel
        out[kernel] = model(step, kv)
    model.decode_kernel = None
    scale = out[False].abs().amax(dim=1, keepdim=True).clamp(min=1)
    assert ((out[True] - out[False]).abs() / scale).amax() < 0.05
    assert (out[True].argmax(1) == out[False].argmax(1)).float().mean() >= 0.75  # bf16 near-ties aside


@pytest.mark.parametrize("which", ["dense+graphs", "moe"])
def test_served_tiny_v3_fp32_matches_transformers(which: str, request: pytest.FixtureRequest) -> None:
    """The served path (scheduler + runner; decode rows through the kernel, fp32 dots in IEEE
    precision; the all-dense model's decode replayed from CUDA graphs) in float32 gives
    transformers' greedy tokens over 32 tokens (a differing token only at a near-tie of
    transformers' own logits)."""
    from transformers import AutoModelForCausalLM

    from engine.config import ServerConfig
    from engine.layers.mla_attention import MLABackend
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    path = request.getfixturevalue("tiny_v3_dense" if which == "dense+graphs" else "tiny_v3")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 40, 3, 26)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    want = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=32)
        want.append(ids[0, len(p):].tolist())
    cfg = ServerConfig(model=str(path), load_format="auto", device="cuda", dtype="float32", page_size=16,
                       max_total_tokens=8192, max_prefill_tokens=64, max_running_requests=16)
    eng = LocalEngine(cfg)
    assert isinstance(eng.runner.backend, MLABackend)
    got = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0,
                                                                       ignore_eos=True))]
    if which == "dense+graphs":
        assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0, "the CUDA graphs were not used"
    assert eng.core.leak_free()
    bad = []
    for i, (p, w, o) in enumerate(zip(prompts, want, got, strict=True)):
        j = next((k for k, (x, y) in enumerate(zip(w, o, strict=True)) if x != y), None)
        if j is not None:
            with torch.inference_mode():
                row = hf(torch.tensor([p + w[:j]], device="cuda")).logits[0, -1].float()
            if (row[w[j]] - row[o[j]]).item() > 1e-3:
                bad.append(f"prompt {i} position {j}: {w[j]} vs {o[j]}")
    assert not bad, bad
