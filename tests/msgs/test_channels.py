"""The channel table: every message on exactly one channel, typed ends, wrong-type frames
dropped and counted on every channel, addresses from one place."""

from __future__ import annotations

import inspect

import msgspec
import pytest
import zmq

from msgs import channels, client, control, done, outputs, requests, steps
from msgs.codec import DROPPED
from msgs.steps import Shutdown
from tests.ports import reserve_ports


def _tagged_structs() -> set[type]:
    found = set()
    for module in (client, control, done, outputs, requests, steps):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, msgspec.Struct) and obj.__struct_config__.tag and obj.__module__ == module.__name__:
                found.add(obj)
    return found


def test_every_message_type_is_carried_by_exactly_one_channel() -> None:
    carried = [t for ch in channels.ALL for t in ch.types]
    ops = set(steps.Op.__args__)  # ops travel inside a Step, not on their own
    assert len(carried) == len(set(carried))
    assert set(carried) | ops == _tagged_structs()


def test_addresses_derive_from_the_table() -> None:
    assert channels.REQUESTS.address("/run") == "ipc:///run/requests"
    assert channels.STEPS.address("/run", rank=1) == "ipc:///run/steps-1"
    with pytest.raises(ValueError):
        channels.STEPS.address("/run")
    with pytest.raises(ValueError):
        channels.DONE.address("/run", rank=0)


def _foreign(channel: channels.Channel) -> bytes:
    """A well-formed frame of some other channel."""
    for other, msg in [
        (channels.REQUESTS, requests.AbortRequest(rid="x")),
        (channels.STEPS, Shutdown()),
    ]:
        if other is not channel:
            return other.codec.encode(msg)
    raise AssertionError


@pytest.mark.parametrize("channel", channels.ALL, ids=lambda c: c.name)
def test_wrong_type_frame_is_dropped_and_counted_on_every_channel(channel: channels.Channel) -> None:
    send, recv = channels.pipe(channel)
    before = DROPPED.get(channel.name, 0)
    recv.push_raw(_foreign(channel))
    recv.push_raw(b"\x00garbage")
    assert recv.poll() and recv.recv() is None and recv.recv() is None
    assert DROPPED[channel.name] == before + 2
    with pytest.raises(TypeError, match=channel.name):
        send.send(requests.AbortRequest(rid="x") if channel is not channels.REQUESTS else Shutdown())


def test_pipe_round_trips_through_the_codec() -> None:
    send, recv = channels.pipe(channels.REQUESTS)
    send.send(requests.AbortRequest(rid="r1"))
    assert list(recv.drain()) == [requests.AbortRequest(rid="r1")]
    assert not recv.poll()


def test_zmq_ends_bind_and_connect_by_role(tmp_path) -> None:
    ctx = zmq.Context()
    try:
        inbox = channels.open_receiver(ctx, channels.DONE, "scheduler", str(tmp_path))  # the binder
        out = channels.open_sender(ctx, channels.DONE, "worker", str(tmp_path))
        out.send(done.WorkerFailed(rank=0, seq=3, reason="test"))
        assert inbox.poll(5000)
        assert inbox.recv() == done.WorkerFailed(rank=0, seq=3, reason="test")
        out.sock.send(b"\xc1")  # malformed on the wire: dropped, the receiver keeps going
        assert inbox.poll(5000) and inbox.recv() is None
        assert (tmp_path / "done").exists()
        out.sock.close(0)
        inbox.sock.close(0)
    finally:
        ctx.term()


def test_cross_node_channels_get_tcp_addresses_bound_by_the_scheduler() -> None:
    """With a TcpPlan (--nnodes > 1) `steps` and `done` go over tcp on the plan's host, node 0's
    scheduler binds both (workers connect); everything else, and the cache's copy, stays ipc."""
    net = channels.TcpPlan(host="10.0.0.5", base_port=29501)
    assert channels.DONE.address("/run", net=net) == "tcp://10.0.0.5:29501"
    assert channels.STEPS.address("/run", rank=0, net=net) == "tcp://10.0.0.5:29502"
    assert channels.STEPS.address("/run", rank=3, net=net) == "tcp://10.0.0.5:29505"
    assert list(net.ports(4)) == [29501, 29502, 29503, 29504, 29505]
    assert channels.STEPS.binds("scheduler", net=net) and not channels.STEPS.binds("worker", net=net)
    assert channels.DONE.binds("scheduler", net=net) and not channels.DONE.binds("worker", net=net)
    assert channels.STEPS.binds("worker") and not channels.STEPS.binds("scheduler")  # one node: unchanged
    assert channels.REQUESTS.address("/run", net=net) == "ipc:///run/requests"
    assert channels.STEPS.address("/run", follower="cache", net=net) == "ipc:///run/steps-cache"
    assert channels.STEPS.binds("cache", follower="cache", net=net)
    assert channels.TcpPlan(host="::1", base_port=5000).address(1) == "tcp://[::1]:5001"
    # the SDK's address too (an IPv6 --host bound it as "tcp://::1:8001", which zmq refuses)
    assert channels.sdk_address("::1", 8001) == "tcp://[::1]:8001"
    assert channels.sdk_address("127.0.0.1", 8001) == "tcp://127.0.0.1:8001"
    with pytest.raises(ValueError):
        channels.STEPS.address("/run", net=net)  # per rank: a rank is needed
    assert sum(bool(ch.tcp_binder) for ch in channels.ALL) == 2
    assert channels.TcpPlan.beside_store("10.0.0.5", 29500) == net  # the store's port, then the channels'


def test_sdk_address_is_formed_by_the_table() -> None:
    assert channels.sdk_address("127.0.0.1", 8001) == "tcp://127.0.0.1:8001"
    assert channels.sdk_address("0.0.0.0", 9) == "tcp://0.0.0.0:9"




def test_zmq_ends_over_tcp(tmp_path) -> None:
    """The scheduler binds, a worker connects (on loopback here), both directions."""
    net = channels.TcpPlan(host="127.0.0.1", base_port=reserve_ports(3))
    ctx = zmq.Context()
    try:
        w_steps = channels.open_receiver(ctx, channels.STEPS, "worker", str(tmp_path), rank=1, net=net)
        w_done = channels.open_sender(ctx, channels.DONE, "worker", str(tmp_path), net=net)
        s_steps = channels.open_sender(ctx, channels.STEPS, "scheduler", str(tmp_path), rank=1, net=net)
        s_done = channels.open_receiver(ctx, channels.DONE, "scheduler", str(tmp_path), net=net)
        s_steps.send(Shutdown())
        assert w_steps.poll(5000) and w_steps.recv() == Shutdown()
        w_done.send(done.WorkerFailed(rank=1, seq=2, reason="test"))
        assert s_done.poll(5000) and s_done.recv() == done.WorkerFailed(rank=1, seq=2, reason="test")
        assert not list(tmp_path.iterdir())  # nothing in the run dir: no ipc
        for end in (w_steps, w_done, s_steps, s_done):
            end.sock.close(0)
    finally:
        ctx.term()


def test_addresses_put_an_ipv6_host_in_brackets() -> None:
    """The ready line's URL and the SDK's endpoint are usable as printed, IPv6 hosts too."""
    from msgs.channels import http_address, tcp_address

    assert http_address("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert http_address("::1", 8000) == "http://[::1]:8000"
    assert tcp_address("::1", 8001) == "tcp://[::1]:8001"
