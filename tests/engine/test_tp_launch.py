"""Tensor-parallel launch plumbing: the flags, each rank's torch.distributed environment,
which processes a node starts, where the cross-node channels listen, and the watch on a
worker's Step stream (no process is started here)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from engine.args import parse_args
from engine.config import ServerConfig
from engine.supervise import DIST_ENV, ChildSet, dist_master, rank_env
from msgs.channels import STEPS, TcpPlan, open_receiver, open_sender
from msgs.steps import Shutdown
from tests.ports import reserve_ports


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
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
    ({"nnodes": 0}, "--nnodes must be >= 1"),
    ({"tp_size": 2, "nnodes": 2}, "needs --dist-init-addr"),
    ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "h:65533"}, "past 65535"),
    ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "h:1", "enable_hierarchical_cache": True}, "node-local"),
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
    # NVLink multicast off in every child (and in a rank that joins in-process: engine/run/dist.py)
    assert DIST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_dist_master_port_is_never_the_http_or_sdk_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer binds --port and --sdk-port after the workers' rendezvous port is picked: a pick
    equal to either (free now, taken a moment later) failed a CI run with EADDRINUSE."""
    import engine.supervise as supervise

    cfg = ServerConfig(port=41001, sdk_port=41002)
    picks = iter([[41001], [41002], [41003]])  # what the OS would hand out, in order
    monkeypatch.setattr(supervise, "free_ports", lambda n, host="127.0.0.1": next(picks))
    assert dist_master(cfg) == ("127.0.0.1", 41003)
    assert dist_master(replace(cfg, dist_init_addr="[::1]:29500")) == ("::1", 29500)


def test_second_node_starts_its_workers_only(tmp_path: Path) -> None:
    cfg = parse_args(["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.1.2.3:29500"])
    assert list(cfg.local_ranks()) == [2, 3]
    assert ChildSet(cfg, tmp_path).names() == ["worker-2", "worker-3"]
    assert ChildSet(replace(cfg, node_rank=0), tmp_path).names() == ["worker-0", "worker-1", "scheduler", "tokenizer"]
    env = rank_env(cfg, 3, dist_master(cfg))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (
        "10.1.2.3", "29500", "3", "4", "1")
    # the Step streams and done: on node 0's host, past the rendezvous port; one node: none (ipc)
    assert cfg.net == TcpPlan(host="10.1.2.3", base_port=29501) and list(cfg.net.ports(4)) == list(range(29501, 29506))
    assert ServerConfig.from_json(cfg.to_json()).net == cfg.net
    assert ServerConfig(tp_size=2, dist_init_addr="10.1.2.3:29500").net is None


def test_watched_steps_delivers_then_fails_when_the_scheduler_goes() -> None:
    """A worker on another node never waits for Steps forever: once the scheduler's end
    closes, frames already sent still arrive, then poll raises within lost_s."""
    from procs.worker import StreamLost, WatchedSteps

    net = TcpPlan(host="127.0.0.1", base_port=reserve_ports(2))  # done, then steps-0
    ctx = zmq.Context()
    try:
        inner = open_receiver(ctx, STEPS, "worker", "/nonexistent", rank=0, net=net)
        steps = WatchedSteps(inner, STEPS.address("/nonexistent", 0, net=net), lost_s=0.3)
        assert not steps.poll(100)  # nobody bound yet: just no message
        sched = open_sender(ctx, STEPS, "scheduler", "/nonexistent", rank=0, net=net)
        sched.send(Shutdown())
        assert steps.poll(5000) and steps.recv() == Shutdown()
        sched.sock.close(0)
        t0 = time.monotonic()
        with pytest.raises(StreamLost, match="lost the Step stream"):
            steps.poll(-1)
        assert time.monotonic() - t0 < 5
        inner.sock.close(0)
        steps.monitor.close(0)
    finally:
        ctx.term()


def test_the_cause_of_a_failure_is_the_child_that_was_killed(tmp_path: Path) -> None:
    """A Fatal from a survivor (its gloo collective broken) or from the scheduler often comes before
    the killed rank's exit is seen: ChildSet.cause names the child that ended, a signal's victim
    before one that exited on its own, never the reporter; None when nobody else ended in time."""
    import signal
    import subprocess
    import sys

    cs = ChildSet(ServerConfig(tp_size=2), tmp_path)
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    cs.procs = {name: subprocess.Popen(sleep) for name in ("worker-0", "worker-1", "scheduler")}
    cs.procs["quitter"] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    try:
        cs.procs["quitter"].wait()
        assert cs.cause("scheduler", 0.1) == ("quitter", "exit status 1")
        cs.procs["worker-1"].send_signal(signal.SIGKILL)
        cs.procs["worker-1"].wait()
        assert cs.cause("worker-0", 0.1) == ("worker-1", "killed by SIGKILL")  # the victim first
        assert cs.cause("scheduler", 0.1) == ("worker-1", "killed by SIGKILL")
        del cs.procs["quitter"], cs.procs["worker-1"]
        t0 = time.monotonic()
        assert cs.cause("scheduler", 0.2) is None and time.monotonic() - t0 >= 0.2
        # after the report: an own exit is its consequence (the scheduler leaving on a worker's
        # failure), a signal's victim still its cause
        later = "import time; time.sleep(0.3); raise SystemExit(1)"
        cs.procs["later"] = subprocess.Popen([sys.executable, "-c", later])
        assert cs.cause("worker-0", 1.0) is None and cs.procs["later"].poll() == 1
        del cs.procs["later"]
        threading.Timer(0.3, cs.procs["scheduler"].kill).start()
        assert cs.cause("worker-0", 2.0) == ("scheduler", "killed by SIGKILL")
    finally:
        for proc in cs.procs.values():
            proc.kill()
            proc.wait()


def test_a_child_stopped_by_sigterm_says_so(tmp_path: Path) -> None:
    """An audit: a worker sent SIGTERM was reported 'died (exit status 0)'. procs/child.py's handler
    exits 128 + SIGTERM, which describe_exit names."""
    import signal
    import subprocess
    import sys

    from engine.supervise import describe_exit

    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM)); "
            "print('up', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGTERM)
    assert describe_exit(proc.wait(timeout=10)) == "stopped by SIGTERM (exit status 143)"
    assert describe_exit(0) == "exit status 0" and describe_exit(-9) == "killed by SIGKILL"
    assert "sys.exit(128 + signal.SIGTERM)" in (Path(__file__).parents[2] / "procs" / "child.py").read_text()
