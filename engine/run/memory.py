"""KV pool sizing: from --max-total-tokens, or from memory left after the weights load."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.config import ServerConfig

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


def plan_pool(cfg: ServerConfig, mcfg, dtype: torch.dtype, device: torch.device) -> PoolPlan:  # noqa: ANN001
    per_token = kv_bytes_per_token(mcfg, dtype)
    if cfg.max_total_tokens:
        tokens = cfg.max_total_tokens
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reserve = 1 << 30  # activations, CUDA graphs, sampler workspace
        budget = int(free * cfg.mem_fraction) - reserve
        if budget < per_token * cfg.page_size * 16:
            raise OutOfMemory(
                f"model loaded but only {free / 2**30:.1f} GiB is free: no room for a KV cache "
                f"({per_token} bytes/token); lower the model size or raise --mem-fraction"
            )
        tokens = budget // per_token
    else:
        budget = min(int(psutil.virtual_memory().available * 0.25), CPU_POOL_CAP_BYTES)
        tokens = budget // per_token
    num_pages = tokens // cfg.page_size + 1
    if num_pages < 2:
        raise OutOfMemory(f"KV pool of {tokens} tokens holds no page of {cfg.page_size}")
    max_model = cfg.context_length or mcfg.max_position_embeddings
    return PoolPlan(num_pages=num_pages, max_context=min(max_model, (num_pages - 1) * cfg.page_size))
