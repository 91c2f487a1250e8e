"""KV pool sizing: from --max-total-tokens, or from memory left after the weights load.

On CUDA the pool gets `free * mem_fraction - reserve` bytes, measured after the weights
are loaded; the reserve covers what is allocated after the pool: activations of the
largest prefill step, logits and sampler temporaries of the largest batch, the attention
workspace and the CUDA graphs (their static inputs and memory pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ServerConfig
from models.config import ModelConfig

CPU_POOL_CAP_BYTES = 4 << 30  # the CPU path is a reference: keep its pool modest


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int  # including the reserved padding page 0
    max_context: int


class OutOfMemory(RuntimeError):
    pass


def kv_bytes_per_token(mcfg, dtype: torch.dtype) -> int:  # noqa: ANN001
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * elem


def weight_bytes(mcfg, dtype: torch.dtype) -> int:  # noqa: ANN001
    """Bytes of the model's parameters in `dtype` (unquantized), from its config."""
    elem = torch.empty((), dtype=dtype).element_size()
    h, i, v = mcfg.hidden_size, mcfg.intermediate_size, mcfg.vocab_size
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + (2 * mcfg.head_dim if mcfg.qk_norm else 0)
    embed = v * h * (1 if mcfg.tie_word_embeddings else 2)
    return elem * (mcfg.num_layers * layer + embed + h)


def check_weights_fit(model_dir: str, dtype: torch.dtype, device: torch.device) -> None:
    """On CUDA, refuse (OutOfMemory, with the numbers) a model whose weights exceed free memory."""
    if device.type != "cuda" or not model_dir:
        return
    mcfg = ModelConfig.from_dir(model_dir)
    need = weight_bytes(mcfg, dtype)
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise OutOfMemory(
            f"the model does not fit: its weights need {need / 2**30:.1f} GiB in {dtype}, but {device} has "
            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB (tensor parallelism is not implemented)"
        )


def runtime_reserve_bytes(cfg: ServerConfig, mcfg, dtype: torch.dtype) -> int:  # noqa: ANN001
    """GPU bytes to leave free after the KV pool: activations of the largest step, logits and
    sampler temporaries of the largest batch, the attention workspace and CUDA graphs."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = cfg.max_prefill_tokens + cfg.max_running_requests
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    per_token = (q + 2 * kv) + q + 3 * mcfg.intermediate_size + 4 * mcfg.hidden_size
    activations = 2 * tokens * per_token * elem  # x2: allocator slack, live tensors across a layer
    # float32 logits plus the sampler's int64 [B, V] noise temporaries (a few alive at once)
    logits = cfg.max_running_requests * mcfg.vocab_size * (4 + 4 * 8)
    workspace = 256 << 20  # flashinfer float workspace; plus int workspaces of the graph wrappers
    graphs = 0 if cfg.disable_cuda_graph else (16 << 20) * 24 + cfg.max_running_requests * mcfg.vocab_size * 4
    return activations + logits + workspace + graphs + (256 << 20)  # + CUDA context growth, cuBLAS


def plan_pool(cfg: ServerConfig, mcfg, kv_dtype: torch.dtype, device: torch.device) -> PoolPlan:  # noqa: ANN001
    per_token = kv_bytes_per_token(mcfg, kv_dtype)
    if cfg.max_total_tokens:
        tokens = cfg.max_total_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = runtime_reserve_bytes(cfg, mcfg, torch.bfloat16)  # activations are never 8-bit
        budget = int(free * cfg.mem_fraction) - reserve
        if budget < per_token * cfg.page_size * 16:
            raise OutOfMemory(
                f"model loaded but only {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is free: after "
                f"--mem-fraction {cfg.mem_fraction} and a {reserve / 2**30:.1f} GiB runtime reserve there is no "
                f"room for a KV cache ({per_token} bytes/token); use a smaller model, raise --mem-fraction, or "
                "lower --max-running-requests / --max-prefill-tokens"
            )
        tokens = budget // per_token
    else:
        import psutil  # lazy: only the CPU path sizes from host memory

        budget = min(int(psutil.virtual_memory().available * 0.25), CPU_POOL_CAP_BYTES)
        tokens = budget // per_token
    num_pages = tokens // cfg.page_size + 1
    if num_pages < 2:
        raise OutOfMemory(f"KV pool of {tokens} tokens holds no page of {cfg.page_size}")
    max_model = cfg.context_length or mcfg.max_position_embeddings
    return PoolPlan(num_pages=num_pages, max_context=min(max_model, (num_pages - 1) * cfg.page_size))
