"""torch.distributed for one worker rank: set up from the supervisor's environment, torn down
without ever waiting on a collective forever.

The supervisor (engine/supervise.py) gives each worker MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE and LOCAL_RANK. A rank uses cuda:LOCAL_RANK and NCCL on GPU, gloo on CPU, and
publishes its groups to the layers (`engine.layers.parallel.set_parallel_state`: tp; ep the same
ranks with --ep-size, else world 1; cp with --cp-size, the ranks of the same tp rank; dp of
world 1 until its flag exists) before the model is built.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from engine.config import ServerConfig
from engine.env import DIST_ENV
from engine.layers import shm_allreduce
from engine.layers.parallel import (
    ParallelState,
    SymmAllReduce,
    TPGroup,
    head_shard,
    parallel_state,
    range_split,
    set_parallel_state,
    symm_all_reduce_ok,
)
from engine.layers.shm_allreduce import ShmAllReduce
from engine.layers.tuning import kernel_tuning
from models.config import ModelConfig

log = structlog.get_logger()

# A collective that waits this long has lost its peer (a rank died mid-step): it raises instead of
# hanging, the worker reports the failure and exits. Far above any step's time (a CPU prefill of the
# largest budget takes seconds); the start-up rendezvous is bounded by it too.
COLLECTIVE_TIMEOUT_S = 120.0
DESTROY_WAIT_S = 5.0  # destroy_process_group hung at exit in an H200 probe: bounded



def init_distributed(cfg: ServerConfig, rank: int) -> torch.device:
    """The device of this rank; at world > 1 also joins the process group (blocking until every
    rank has joined, at most COLLECTIVE_TIMEOUT_S) and sets the layers' parallel state."""
    device = torch.device(cfg.resolved_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    if cfg.world_size == 1:
        set_parallel_state(ParallelState())  # every group of world 1
        return device
    for key, value in DIST_ENV.items():
        os.environ[key] = value
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"--tp-size {cfg.tp_size} x --cp-size {cfg.cp_size}: {', '.join(missing)} not set "
                           "(the supervisor sets them)")
    world = int(os.environ.get("WORLD_SIZE", cfg.world_size))
    if world != cfg.world_size or int(os.environ.get("RANK", rank)) != rank:
        raise RuntimeError(f"environment RANK/WORLD_SIZE disagree with rank {rank} of --tp-size {cfg.tp_size} "
                           f"x --cp-size {cfg.cp_size}")
    local = int(os.environ.get("LOCAL_RANK", rank))
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        kwargs["device_id"] = device  # eager NCCL communicator: ready before CUDA graphs are captured
        backend = "nccl"
    else:
        backend = "gloo"
        if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
            # one host: gloo would otherwise bind the interface the hostname resolves to, which
            # containers often cannot reach
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs
    )
    state = _groups(cfg, rank, device)
    set_parallel_state(state)
    log.info("process groups joined", backend=backend, world=world, tp=f"{state.tp.rank}/{state.tp.world}",
             cp=f"{state.cp.rank}/{state.cp.world}", device=str(device),
             master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
             symm_allreduce_max_bytes=state.tp.symm.max_bytes if state.tp.symm is not None else 0)
    return device


def rank_layout(rank: int, tp_size: int) -> tuple[int, int]:
    """(tp rank, cp rank) of a global rank: tp innermost, rank = cp_rank * tp_size + tp_rank, so a
    tp group is consecutive ranks (GPUs of one NVLink island first) and a cp group strides by
    tp_size, as SGLang lays out its attention groups inside the world."""
    return rank % tp_size, rank // tp_size


def _groups(cfg: ServerConfig, rank: int, device: torch.device) -> ParallelState:
    """This rank's groups. Every rank creates every subgroup, in the same order (torch.distributed's
    rule for new_group); at cp 1 the tp group is the whole world, as before."""
    tp_rank, cp_rank = rank_layout(rank, cfg.tp_size)
    if cfg.cp_size == 1:
        symm = _symm_all_reduce(device) or _shm_all_reduce(cfg, dist.group.WORLD, rank, cfg.tp_size, device)
        t = TPGroup(rank, cfg.tp_size, dist.group.WORLD, symm)
        return ParallelState(tp=t, ep=t if cfg.ep_size > 1 else TPGroup())  # --ep-size: the same ranks
    tp_groups = [dist.new_group([c * cfg.tp_size + t for t in range(cfg.tp_size)]) for c in range(cfg.cp_size)]
    cp_groups = [dist.new_group([c * cfg.tp_size + t for c in range(cfg.cp_size)]) for t in range(cfg.tp_size)]
    # the one-shot all-reduce is set up over the whole world only: under cp, NCCL for every size
    # (on CPU each tp group gets its shared-memory one, and each cp group one for the merge's all-gather)
    t = TPGroup()
    if cfg.tp_size > 1:
        t = TPGroup(tp_rank, cfg.tp_size, tp_groups[cp_rank],
                    _shm_all_reduce(cfg, tp_groups[cp_rank], tp_rank, cfg.tp_size, device))
    c = TPGroup(cp_rank, cfg.cp_size, cp_groups[tp_rank],
                _shm_all_reduce(cfg, cp_groups[tp_rank], cp_rank, cfg.cp_size, device))
    return ParallelState(tp=t, ep=t if cfg.ep_size > 1 else TPGroup(), cp=c)


def _symm_all_reduce(device: torch.device) -> SymmAllReduce | None:
    """The one-shot all-reduce for small messages where this GPU's tuning file turns it on
    (`tp_symm_allreduce_max_bytes`), set up on every rank before any model or CUDA graph; None
    (NCCL for every size) where it does not, or where set-up failed on any rank: the ranks agree
    with one NCCL all-reduce, so that every rank takes the same path for every message."""
    max_bytes = kernel_tuning(device).tp_symm_allreduce_max_bytes if device.type == "cuda" else 0
    if not max_bytes:
        return None
    symm, why = None, "unavailable in this torch"
    if symm_all_reduce_ok(max_bytes, device):
        try:
            symm = SymmAllReduce(dist.group.WORLD, max_bytes, device)
        except Exception as exc:  # noqa: BLE001 - any failure: NCCL, on every rank
            why = f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([1 if symm is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        return symm
    log.warning("one-shot all-reduce not set up: NCCL for every size", reason=why if symm is None else "a peer failed")
    return None


def _shm_all_reduce(cfg: ServerConfig, group: object, group_rank: int, world: int,
                    device: torch.device) -> ShmAllReduce | None:
    """CPU ranks on one node: the group's all-reduce (and all-gather) through shared memory
    (engine/layers/shm_allreduce.py; ~50 us against gloo's ~2 ms on a 2-core host), or None (gloo)."""
    if cfg.nnodes > 1 or not shm_allreduce.available(device):
        return None
    shm = shm_allreduce.setup(group, group_rank, world, COLLECTIVE_TIMEOUT_S)
    if shm is None:
        log.warning("shared-memory all-reduce not set up: gloo for every size")
    return shm


def rank_config(mcfg: ModelConfig) -> ModelConfig:
    """The model config as this rank sees it: its q and K/V heads, its slice of the MLP (for the
    KV pool, the attention backend and memory sizing); the vocabulary stays whole, since the
    logits are gathered before sampling. At tp 1, mcfg itself."""
    t = parallel_state().tp
    if t.world == 1:
        return mcfg
    heads = head_shard(mcfg.num_heads, mcfg.num_kv_heads, t.rank, t.world)
    start, end = range_split(mcfg.intermediate_size, t.world, t.rank)
    return dataclasses.replace(mcfg, num_heads=heads.num_q, num_kv_heads=heads.num_kv, intermediate_size=end - start)


def shutdown_distributed(exit_code: int, wait_s: float = DESTROY_WAIT_S) -> None:
    """Leave the process group, waiting at most wait_s; if it does not return (a peer gone in
    the middle of a collective), exit now with exit_code rather than hang at interpreter exit."""
    if not dist.is_available() or not dist.is_initialized():
        return
    t = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        log.warning("destroy_process_group did not return; exiting without it", wait_s=wait_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
