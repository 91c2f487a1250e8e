"""KV pool sizing: from --max-total-tokens, or from the device's memory and the workload.

On CUDA the pool gets `free * mem_fraction - reserve` bytes, measured after the weights
are loaded; the reserve covers what is allocated after the pool: activations of the
largest prefill step, logits and sampler temporaries of the largest batch, the attention
workspace and the CUDA graphs (their static inputs and memory pool).

On CPU host memory is shared with everything else on the machine, and a CPU worker cannot
use a large pool anyway (a full 8k-token context takes tens of seconds to prefill on a few
cores), so the pool is what the workload can use, `max_running_requests x context` tokens,
capped at CPU_POOL_RAM_FRACTION of the machine's RAM (and half of what is available now),
but never below one full context when that much is available.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.config import ServerConfig
from models.config import ModelConfig
from models.registry import kv_layout
from msgs.params import PROMPT_SCORE_CHUNK

CPU_POOL_RAM_FRACTION = 1 / 16  # of total RAM: 1.5 GiB (34k tokens of SmolLM2-135M) on a 24 GiB machine


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int  # including the reserved padding page 0
    max_context: int
    sized_by: str = ""  # how the size was chosen, for the start-up log line
    wanted_context: int = 0  # --context-length, else the model's: more than max_context when the pool caps it

    @property
    def context_capped(self) -> bool:
        return self.max_context < self.wanted_context


class OutOfMemory(RuntimeError):
    pass


def kv_bytes_per_token(mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes a token costs across every layer, by the layout the model declares (K and V per
    KV head, or MLA's latent) for this config (a rank's shard at tp > 1)."""
    return kv_layout(mcfg).bytes_per_token(mcfg.num_layers, dtype)


def weight_bytes(mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in `dtype` (unquantized), from its config."""
    elem = torch.empty((), dtype=dtype).element_size()
    h, v = mcfg.hidden_size, mcfg.vocab_size
    layer = attention_params(mcfg) + 2 * h
    mlps = sum(mlp_params(mcfg, i) for i in range(mcfg.num_layers))
    embed = v * h * (1 if mcfg.tie_word_embeddings else 2)
    return elem * (mcfg.num_layers * layer + mlps + embed + h)


def attention_params(mcfg: ModelConfig) -> int:
    """Parameters of one layer's attention: GQA's q/k/v/o projections (q/k norms, biases), or MLA's
    (q_a_proj, q_a_layernorm, q_b_proj or a plain q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj)."""
    h, m = mcfg.hidden_size, getattr(mcfg, "mla", None)
    if m is not None:
        heads, qk, r = mcfg.num_heads, m.qk_head_dim, m.kv_lora_rank
        q = h * heads * qk if m.q_lora_rank is None else (h + 1 + heads * qk) * m.q_lora_rank
        bias = (m.q_lora_rank or 0) + m.latent_dim + h if mcfg.attention_bias else 0
        return q + h * m.latent_dim + r + r * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h \
            + bias
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    params = h * (q + 2 * kv) + q * h + (2 * mcfg.head_dim if mcfg.qk_norm else 0)
    return params + (q + 2 * kv if mcfg.attention_bias else 0) + (h if mcfg.o_proj_bias else 0)


def mlp_params(mcfg: ModelConfig, layer_id: int) -> int:
    """Parameters of one layer's MLP: the dense SwiGLU, or an MoE block (every routed expert, not
    only the active ones, the shared experts, the router and its score-correction bias)."""
    h, moe = mcfg.hidden_size, getattr(mcfg, "moe", None)
    if moe is None or layer_id not in moe.layers:
        return 3 * h * mcfg.intermediate_size
    experts = (moe.num_experts + moe.num_shared_experts) * 3 * h * moe.intermediate_size
    return experts + moe.num_experts * h + (moe.num_experts if moe.topk_method == "noaux_tc" else 0)


def draft_bytes(cfg: ServerConfig, mcfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes a token, fixed bytes) that this rank's speculative draft adds beside the target
    (`mcfg`: the target's rank shard), so that the KV pool leaves room for it: a separate draft
    model's KV pool (over the target's pages, in the model dtype) and weights; a head's (EAGLE,
    EAGLE3, NEXTN) KV pool (in the KV dtype), its hidden-state pool and its weights; nothing for
    NGRAM or a self-draft (the target's own layers and KV). Weights counted whole where a head
    shares the target's embedding: a slight overestimate, on the safe side."""
    from engine.run.dist import rank_config

    algo, path = cfg.speculative_algorithm, cfg.speculative_draft_model_path
    elem = torch.empty((), dtype=dtype).element_size()
    if algo == "STANDALONE" and path:
        d = rank_config(ModelConfig.from_dir(path))
        return kv_bytes_per_token(d, dtype), weight_bytes(d, dtype)
    if algo in ("EAGLE", "EAGLE3"):
        from models.eagle import read_head

        head = rank_config(read_head(path, algo).cfg)
        return kv_bytes_per_token(head, kv_dtype) + head.hidden_size * elem, weight_bytes(head, dtype)
    if algo == "NEXTN":  # one decoder layer of the target's (its MoE), eh_proj, norms, its latent pool
        h = mcfg.hidden_size
        layer = attention_params(mcfg) + mlp_params(mcfg, mcfg.num_layers - 1) + 2 * h * h + 4 * h
        return kv_layout(mcfg).bytes_per_token(1, kv_dtype) + h * elem, layer * elem
    return 0, 0


def check_weights_fit(model_dir: str, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
                      host_ranks: int = 1) -> None:
    """Refuse (OutOfMemory, with the numbers) a model whose weights (this rank's share of them at
    tp_size > 1, about 1/tp_size) exceed free GPU memory; on a CPU, whose `host_ranks` workers'
    shares together exceed the host's memory (the kernel's OOM killer would end the start after
    minutes of loading, with nothing said; the total, not what is free now: this host's other
    ranks are loading at the same time)."""
    if device.type not in ("cuda", "cpu") or not model_dir:
        return
    mcfg = ModelConfig.from_dir(model_dir)
    need = weight_bytes(mcfg, dtype) // tp_size
    if device.type == "cpu":
        total = psutil.virtual_memory().total
        if need * host_ranks > total:
            raise OutOfMemory(
                f"the model does not fit: its weights need {need * host_ranks / 2**30:.1f} GiB in {dtype} on this "
                f"host ({host_ranks} worker(s) of {need / 2**30:.1f} GiB), which has {total / 2**30:.1f} GiB of memory"
            )
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise OutOfMemory(
            f"the model does not fit: its weights need {need / 2**30:.1f} GiB in {dtype}, but {device} has "
            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB at --tp-size {tp_size}"
        )


def runtime_reserve_bytes(cfg: ServerConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """GPU bytes to leave free after the KV pool: activations of the largest step, logits and
    sampler temporaries of the largest batch, the attention workspace and CUDA graphs."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = cfg.max_prefill_tokens + cfg.max_running_requests
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    per_token = (q + 2 * kv) + q + 3 * mcfg.intermediate_size + 4 * mcfg.hidden_size
    m = getattr(mcfg, "mla", None)
    if m is not None:  # MLA prefill: q and the latents expanded to per-head K and V, the output (a chunk's rows)
        per_token += mcfg.num_heads * (2 * m.qk_head_dim + 2 * m.v_head_dim)
    moe = getattr(mcfg, "moe", None)
    if moe is not None:  # the MoE torch path's [T * top_k, hidden] gathered inputs and outputs, gate_up rows
        per_token += moe.top_k * (3 * mcfg.hidden_size + 3 * moe.intermediate_size)
    activations = 2 * tokens * per_token * elem  # x2: allocator slack, live tensors across a layer
    # float32 logits plus the sampler's int64 [B, V] noise temporaries (a few alive at once), or a
    # scored prompt chunk's float32 logits and their log_softmax (engine/run/prompt_scores.py)
    logits = max(cfg.max_running_requests * (4 + 4 * 8), PROMPT_SCORE_CHUNK * 2 * 4) * mcfg.vocab_size
    workspace = 256 << 20  # flashinfer float workspace; plus int workspaces of the graph wrappers
    graphs = 0 if cfg.disable_cuda_graph else (16 << 20) * 24 + cfg.decode_graph_rows * mcfg.vocab_size * 4
    return activations + logits + workspace + graphs + _split_scratch_bytes(cfg, mcfg) + (256 << 20)  # + cuBLAS etc.


def _split_scratch_bytes(cfg: ServerConfig, mcfg: ModelConfig) -> int:
    """Deterministic inference's split-KV decode scratch for CUDA graphs (torch backend,
    batch_invariant.split_scratch): float32 [rows, partitions of the longest context, Hq, D + 2],
    e.g. 130 MiB for Llama-3.1-8B at 128k (16 split rows). Zero with the mode off or without graphs."""
    if not cfg.enable_deterministic_inference or cfg.disable_cuda_graph or getattr(mcfg, "mla", None) is not None:
        return 0
    from engine.layers import batch_invariant

    rows = min(cfg.decode_graph_rows, batch_invariant.split_rows(mcfg.num_kv_heads))
    context = cfg.context_length or mcfg.max_position_embeddings
    parts = -(-context // batch_invariant.kv_part(cfg.page_size)) + 1
    return rows * parts * mcfg.num_heads * (mcfg.head_dim + 2) * 4


def cpu_pool_tokens(
    cfg: ServerConfig, mcfg: ModelConfig, per_token: int, total_ram: int, available_ram: int
) -> int:
    """Default CPU pool size in tokens (see the module docstring); RAM figures in bytes."""
    context = cfg.context_length or mcfg.max_position_embeddings
    want = cfg.max_running_requests * context
    affordable = available_ram // 2 // per_token
    cap = min(int(total_ram * CPU_POOL_RAM_FRACTION) // per_token, affordable)
    return min(want, max(cap, min(context, affordable)))


def plan_pool(cfg: ServerConfig, mcfg: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
              dtype: torch.dtype = torch.bfloat16) -> PoolPlan:
    """The KV pool's pages: --max-total-tokens, else what the device's memory holds beside the
    runtime reserve and a speculative draft's KV and weights (`draft_bytes`), whose pools take
    as many pages as the target's."""
    draft_per_token, draft_fixed = draft_bytes(cfg, mcfg, dtype, kv_dtype)
    per_token = kv_bytes_per_token(mcfg, kv_dtype) + draft_per_token
    if cfg.max_total_tokens:
        tokens, sized_by = cfg.max_total_tokens, "--max-total-tokens"
        _check_fits(tokens * per_token, device)
    elif device.type == "cuda":
        tokens = _cuda_pool_tokens(cfg, mcfg, per_token, device, draft_fixed)
        sized_by = f"--mem-fraction {cfg.mem_fraction}" + (" (with the speculative draft's)" if draft_per_token else "")
    else:
        mem = psutil.virtual_memory()
        tokens = cpu_pool_tokens(cfg, mcfg, per_token, mem.total, mem.available)
        sized_by = (
            f"cpu: min({cfg.max_running_requests} requests x context, 1/{round(1 / CPU_POOL_RAM_FRACTION)} "
            f"of {mem.total / 2**30:.1f} GiB RAM); --max-total-tokens overrides"
        )
    num_pages = tokens // cfg.page_size + 1
    if num_pages < 2:
        raise OutOfMemory(f"KV pool of {tokens} tokens holds no page of {cfg.page_size} (--page-size)")
    max_model = cfg.context_length or mcfg.max_position_embeddings
    # under context parallelism a request's pages round robin over the cp ranks' pools (each of
    # num_pages): one request may hold cp x one pool's pages (docs/architecture.md)
    held = cfg.cp_size * (num_pages - 1) * cfg.page_size
    return PoolPlan(num_pages=num_pages, max_context=min(max_model, held), sized_by=sized_by, wanted_context=max_model)


def _check_fits(pool_bytes: int, device: torch.device) -> None:
    """--max-total-tokens's KV pool against the memory free now (host RAM on CPU): an OutOfMemory
    naming the flag, not a failed allocation or an OOM kill under load later."""
    if device.type == "cuda":  # what torch's caching allocator holds unused is free to the pool too
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + cached
    else:
        import psutil

        free = psutil.virtual_memory().available
    if pool_bytes > free:
        raise OutOfMemory(f"--max-total-tokens: its KV cache needs {pool_bytes / 2**30:.1f} GiB, and "
                          f"{free / 2**30:.1f} GiB of {device.type} memory is free")


def _cuda_pool_tokens(cfg: ServerConfig, mcfg: ModelConfig, per_token: int, device: torch.device,
                      draft_fixed: int = 0) -> int:
    free, total = torch.cuda.mem_get_info(device)
    # activations are never 8-bit; a draft's weights are loaded after the pool is sized
    reserve = runtime_reserve_bytes(cfg, mcfg, torch.bfloat16) + draft_fixed
    budget = int(free * cfg.mem_fraction) - reserve
    if budget < per_token * cfg.page_size * 16:
        raise OutOfMemory(
            f"model loaded but only {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is free: after "
            f"--mem-fraction {cfg.mem_fraction} and a {reserve / 2**30:.1f} GiB runtime reserve there is no "
            f"room for a KV cache ({per_token} bytes/token); use a smaller model, raise --mem-fraction, or "
            "lower --max-running-requests / --max-prefill-tokens"
        )
    return budget // per_token
