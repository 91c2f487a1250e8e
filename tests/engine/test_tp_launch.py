"""Tensor-parallel launch plumbing: the flags, each rank's torch.distributed environment, and
which processes a node starts (no process is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.args import parse_args
from engine.config import ServerConfig
from engine.supervise import DIST_ENV, ChildSet, dist_master, rank_env


def test_tp_flags() -> None:
    cfg = parse_args(["--tp-size", "2", "--dist-init-addr", "10.1.2.3:29500"])
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, list(cfg.local_ranks())) == (2, 1, 0, [0, 1])
    assert dist_master(cfg) == ("10.1.2.3", 29500)
    host, port = dist_master(ServerConfig(tp_size=2))
    assert host == "127.0.0.1" and 0 < port < 65536


@pytest.mark.parametrize(("kw", "message"), [
    ({"tp_size": 0}, "--tp-size"),
    ({"dist_init_addr": "nohost"}, "HOST:PORT"),
    ({"dist_init_addr": "h:99999"}, "HOST:PORT"),
    ({"tp_size": 3, "nnodes": 2}, "multiple of --nnodes"),
    ({"node_rank": 1}, "--node-rank"),
    ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "h:1"}, "tcp Step/done channels"),
])
def test_bad_tp_flags(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kw)


def test_rank_env_and_children(tmp_path: Path) -> None:
    cfg = ServerConfig(tp_size=2, run_dir=str(tmp_path))
    env = rank_env(cfg, 1, ("127.0.0.1", 4242))
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "RANK": "1", "WORLD_SIZE": "2",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert ChildSet(cfg, tmp_path).names() == ["worker-0", "worker-1", "scheduler", "tokenizer"]
    assert DIST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def test_workers_keep_multicast_off_themselves() -> None:
    """engine/run/dist.py sets the same switches in the worker (and NVSHMEM's), whoever started it."""
    from engine.run.dist import DIST_ENV as WORKER_ENV

    assert WORKER_ENV.items() >= DIST_ENV.items() and WORKER_ENV["NVSHMEM_DISABLE_NVLS"] == "1"
