"""The channel table: every ZMQ channel of Strata, declared once.

| channel  | pattern      | sender -> receiver           | binds      | messages                              |
|----------|--------------|------------------------------|------------|---------------------------------------|
| requests | PUSH/PULL    | tokenizer -> scheduler       | scheduler  | TokenizedRequest, AbortRequest,       |
|          |              |                              |            | FlushCache                            |
| outputs  | PUSH/PULL    | scheduler -> tokenizer       | tokenizer  | TokenBatch, SchedulerStats, FlushDone |
| steps    | PUSH/PULL    | scheduler -> worker (1/rank) | worker [1] | Step, Shutdown                        |
|          |              | and -> cache (a follower)    | cache      |                                       |
| done     | PUSH/PULL    | workers -> scheduler         | scheduler  | StepDone, SpecDone, WorkerReady,      |
|          |              |                              | [1]        | WorkerFailed                          |
| backups  | PUSH/PULL    | workers -> cache             | cache      | BackupDone                            |
| commits  | PUSH/PULL    | cache -> scheduler           | scheduler  | Committed, ControllerDigest,          |
|          |              |                              |            | ControllerFailed, L3Loaded, L3Stats   |
| control  | PUSH/PULL    | children -> supervisor       | supervisor | Ready, Fatal, Flushed                 |
| notices  | PUSH/PULL    | supervisor -> tokenizer      | supervisor | ProcessDied                           |
| sdk      | DEALER/ROUTER| client <-> tokenizer (tcp)   | tokenizer  | GenerateRequest, AbortGenerate /      |
|          |              |                              |            | GenerateChunk, GenerateError,         |
|          |              |                              |            | KeepAlive                             |

[1] with --nnodes > 1 these two cross nodes: tcp (TcpPlan), bound by node 0's scheduler.

Every address is formed here. A `Channel` knows its address (ipc in the supervisor's private
run dir; for the channels that cross nodes, `steps` per rank and `done` with --nnodes > 1, tcp
from a `TcpPlan`: --dist-init-addr's host, port base + slot (+ rank); the SDK's tcp address
comes from `sdk_address`), its high-water mark (0:
never drop, never block the sender's peer) and its codec. Typed ends wrap a socket:
`Sender.send` refuses a message type the channel does not carry (a bug at the source),
`Receiver.recv` decodes through the codec, which drops, counts and (rate-limited) logs
any frame that is malformed or of another channel's type.

`pipe(channel)` gives both ends over an in-memory queue, through the same encode/decode,
so drivers (scheduler loop, worker pipeline) run in tests without sockets or sleeps.
"""

from __future__ import annotations

import os
import typing
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import zmq
import zmq.asyncio

from msgs import client, control, done, outputs, requests, steps
from msgs.codec import Codec

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Channel(Generic[T]):
    name: str  # ipc file name, log and metric label
    sender: str  # process role that sends
    receiver: str  # process role that receives
    binder: str  # the role that binds (the stable end); the other connects
    union: Any  # the message types this channel carries
    hwm: int = 0  # 0: unlimited; nothing on these channels may be dropped
    per_rank: bool = False  # one socket per worker rank (the Step stream)
    followers: tuple[str, ...] = ()  # roles that get their own copy of the stream (the cache controller)
    # crosses nodes with --nnodes > 1: over tcp, `tcp_binder` binds port `TcpPlan.base_port +
    # tcp_slot (+ rank)` ("" = node-local, ipc only). Over tcp the binder is always node 0's
    # scheduler, so that node 0 never needs to know where the other nodes' workers run.
    tcp_binder: str = ""
    tcp_slot: int = 0
    codec: Codec[T] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec(self.union, self.name))

    @property
    def types(self) -> tuple[type, ...]:
        return typing.get_args(self.union) or (self.union,)

    def address(
        self, run_dir: str, rank: int | None = None, follower: str | None = None, net: TcpPlan | None = None
    ) -> str:
        """ipc in run_dir; tcp when `net` is given and this channel crosses nodes."""
        if net is not None and self.tcp_binder and follower is None:
            if self.per_rank != (rank is not None):
                raise ValueError(f"channel {self.name}: rank {rank!r} given for per_rank={self.per_rank}")
            return net.address(self.tcp_slot + (rank or 0))
        if follower is not None:
            if follower not in self.followers or rank is not None:
                raise ValueError(f"channel {self.name}: {follower!r} does not follow it (rank {rank!r})")
            return f"ipc://{os.path.join(run_dir, f'{self.name}-{follower}')}"
        if self.per_rank != (rank is not None):
            raise ValueError(f"channel {self.name}: rank {rank!r} given for per_rank={self.per_rank}")
        name = self.name if rank is None else f"{self.name}-{rank}"
        return f"ipc://{os.path.join(run_dir, name)}"

    def binds(self, role: str, follower: str | None = None, net: TcpPlan | None = None) -> bool:
        """Whether `role` binds its end (else it connects)."""
        if net is not None and self.tcp_binder and follower is None:
            return role == self.tcp_binder
        return role == (follower or self.binder)


@dataclass(frozen=True)
class TcpPlan:
    """Where the channels that cross nodes listen, with --nnodes > 1 (engine/config.py builds
    it from --dist-init-addr HOST:PORT, and checks the ports fit): on HOST, port PORT + 1 + slot,
    i.e. `done` on PORT+1 and `steps` of rank r on PORT+2+r. PORT itself is torch.distributed's
    store (rank 0). Node 0's scheduler binds them all; every worker, on every node, connects:
    node 0 never needs the other nodes' addresses. HOST is bound as given (127.0.0.1 stays
    loopback; 0.0.0.0 only when the user passes it)."""

    host: str
    base_port: int  # the dist-init port + 1

    @classmethod
    def beside_store(cls, host: str, store_port: int) -> TcpPlan:
        """The plan of --dist-init-addr HOST:PORT: the channels take the ports after the store's."""
        return cls(host=host, base_port=store_port + 1)

    def address(self, slot: int) -> str:
        return tcp_address(self.host, self.base_port + slot)

    def ports(self, tp_size: int) -> range:
        """Every port the plan uses: done, then steps of ranks 0..tp_size-1."""
        return range(self.base_port, self.base_port + 1 + tp_size)


def tcp_address(host: str, port: int) -> str:
    """A zmq tcp endpoint; an IPv6 host in brackets."""
    return f"tcp://{_bracketed(host)}:{port}"


def http_address(host: str, port: int) -> str:
    """The HTTP API's URL (the ready line's); an IPv6 host in brackets."""
    return f"http://{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def sdk_address(host: str, port: int) -> str:
    """The SDK's one ROUTER socket (SDK_IN and SDK_OUT), bound by the tokenizer on --host and
    --sdk-port; what a client passes to msgs.sdk.Client."""
    return tcp_address(host, port)


# tcp heartbeats on the sockets that cross nodes: a peer whose host vanished (no FIN) is
# dropped within HEARTBEAT_TIMEOUT_MS, so a follower sees the stream lost (procs/worker.py)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


#        name          sender       receiver      binder        messages
REQUESTS = Channel("requests", "tokenizer", "scheduler", "scheduler", requests.ToScheduler)
OUTPUTS = Channel("outputs", "scheduler", "tokenizer", "tokenizer", outputs.ToTokenizer)
STEPS = Channel("steps", "scheduler", "worker", "worker", steps.ToWorker, per_rank=True, followers=("cache",),
                tcp_binder="scheduler", tcp_slot=1)  # tcp: slot 1 + rank
DONE = Channel("done", "worker", "scheduler", "scheduler", done.FromWorker, tcp_binder="scheduler", tcp_slot=0)
BACKUPS = Channel("backups", "worker", "cache", "cache", done.ToController)
COMMITS = Channel("commits", "cache", "scheduler", "scheduler", done.FromController)
CONTROL = Channel("control", "child", "supervisor", "supervisor", control.ToSupervisor)
NOTICES = Channel("notices", "supervisor", "tokenizer", "supervisor", control.ToTokenizerControl)
# The SDK is one ROUTER socket (tokenizer, tcp) talking to DEALER clients: two directions,
# bounded queues (a client that stops reading must not grow the server's memory).
SDK_IN = Channel("sdk-in", "client", "tokenizer", "tokenizer", client.ToServer, hwm=1000)
SDK_OUT = Channel("sdk-out", "tokenizer", "client", "tokenizer", client.FromServer, hwm=1000)

ALL: tuple[Channel[Any], ...] = (
    REQUESTS, OUTPUTS, STEPS, DONE, BACKUPS, COMMITS, CONTROL, NOTICES, SDK_IN, SDK_OUT
)


# ---- typed ends ---------------------------------------------------------------------------


class Inbox(Protocol[T_co]):
    """What a driver (scheduler loop, worker pipeline) reads a channel through: a Receiver over
    a socket or a `pipe` end in tests. `poll` waits up to timeout_ms for a message; `recv`
    returns the next one, or None for a frame the codec dropped (malformed: counted, logged)."""

    def poll(self, timeout_ms: int = 0) -> bool: ...
    def recv(self) -> T_co | None: ...


class Outbox(Protocol[T]):
    """What a driver writes a channel through: `send` queues a message of the channel's types
    (another type is a bug at the source: refused), never dropping it."""

    def send(self, msg: T) -> None: ...


class Sender(Generic[T]):
    """The sending end of a channel over a zmq socket (sync)."""

    def __init__(self, channel: Channel[T], sock: zmq.Socket) -> None:
        self.channel = channel
        self.sock = sock
        self._types = channel.types

    def send(self, msg: T, block: bool = True) -> None:
        """block=False raises zmq.Again when the message cannot be queued (no peer)."""
        if not isinstance(msg, self._types):
            raise TypeError(f"channel {self.channel.name} does not carry {type(msg).__name__}")
        self.sock.send(self.channel.codec.encode(msg), 0 if block else zmq.NOBLOCK)


class Receiver(Generic[T]):
    """The receiving end (sync). recv() returns None for a dropped frame."""

    def __init__(self, channel: Channel[T], sock: zmq.Socket) -> None:
        self.channel = channel
        self.sock = sock

    def poll(self, timeout_ms: int = 0) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> T | None:
        return self.channel.codec.decode(self.sock.recv())

    def drain(self) -> Iterator[T]:
        """Every message already queued (dropped frames skipped), without blocking."""
        while self.poll(0):
            msg = self.recv()
            if msg is not None:
                yield msg


class AsyncSender(Generic[T]):
    def __init__(self, channel: Channel[T], sock: zmq.asyncio.Socket) -> None:
        self.channel = channel
        self.sock = sock
        self._types = channel.types

    async def send(self, msg: T) -> None:
        if not isinstance(msg, self._types):
            raise TypeError(f"channel {self.channel.name} does not carry {type(msg).__name__}")
        await self.sock.send(self.channel.codec.encode(msg))


class AsyncReceiver(Generic[T]):
    def __init__(self, channel: Channel[T], sock: zmq.asyncio.Socket) -> None:
        self.channel = channel
        self.sock = sock

    async def recv(self) -> T | None:
        return self.channel.codec.decode(await self.sock.recv())


def _socket(
    ctx: zmq.Context, kind: int, channel: Channel[Any], role: str, run_dir: str, rank: int | None,
    follower: str | None = None, net: TcpPlan | None = None,
) -> Any:
    sock = ctx.socket(kind)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, channel.hwm)
    else:
        sock.setsockopt(zmq.RCVHWM, channel.hwm)
    addr = channel.address(run_dir, rank, follower, net)
    if addr.startswith("tcp://") and channel.tcp_binder:
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if addr.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
    if channel.binds(role, follower, net):  # a follower binds its own copy of the stream
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


def open_sender(
    ctx: zmq.Context, channel: Channel[T], role: str, run_dir: str, rank: int | None = None, linger_ms: int = 0,
    follower: str | None = None, net: TcpPlan | None = None,
) -> Sender[T]:
    """`role` is the calling process's role: it binds when it is the channel's binder.
    `follower`: the end of a follower's copy of the stream (e.g. STEPS for "cache").
    `net` (ServerConfig.net, with --nnodes > 1): the channels that cross nodes go over tcp."""
    sock = _socket(ctx, zmq.PUSH, channel, role, run_dir, rank, follower, net)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return Sender(channel, sock)


def open_receiver(
    ctx: zmq.Context, channel: Channel[T], role: str, run_dir: str, rank: int | None = None,
    follower: str | None = None, net: TcpPlan | None = None,
) -> Receiver[T]:
    sock = _socket(ctx, zmq.PULL, channel, role, run_dir, rank, follower, net)
    sock.setsockopt(zmq.LINGER, 0)
    return Receiver(channel, sock)


def open_async_sender(
    ctx: zmq.asyncio.Context, channel: Channel[T], role: str, run_dir: str, linger_ms: int = 0
) -> AsyncSender[T]:
    sock = _socket(ctx, zmq.PUSH, channel, role, run_dir, None)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return AsyncSender(channel, sock)


def open_async_receiver(ctx: zmq.asyncio.Context, channel: Channel[T], role: str, run_dir: str) -> AsyncReceiver[T]:
    sock = _socket(ctx, zmq.PULL, channel, role, run_dir, None)
    sock.setsockopt(zmq.LINGER, 0)
    return AsyncReceiver(channel, sock)


# ---- in memory (tests, single-process drivers) --------------------------------------------


class MemorySender(Generic[T]):
    def __init__(self, channel: Channel[T], queue: deque[bytes]) -> None:
        self.channel = channel
        self.queue = queue
        self._types = channel.types

    def send(self, msg: T) -> None:
        if not isinstance(msg, self._types):
            raise TypeError(f"channel {self.channel.name} does not carry {type(msg).__name__}")
        self.queue.append(self.channel.codec.encode(msg))


class MemoryReceiver(Generic[T]):
    def __init__(self, channel: Channel[T], queue: deque[bytes]) -> None:
        self.channel = channel
        self.queue = queue

    def poll(self, timeout_ms: int = 0) -> bool:
        return bool(self.queue)  # nothing else can fill it while we wait: never sleeps

    def recv(self) -> T | None:
        return self.channel.codec.decode(self.queue.popleft())

    def push_raw(self, frame: bytes) -> None:
        """Inject a raw frame (tests: malformed or wrong-type frames)."""
        self.queue.append(frame)

    def drain(self) -> Iterator[T]:
        while self.queue:
            msg = self.recv()
            if msg is not None:
                yield msg


def pipe(channel: Channel[T]) -> tuple[MemorySender[T], MemoryReceiver[T]]:
    """Both ends of a channel over one in-memory queue (same codec as the wire)."""
    queue: deque[bytes] = deque()
    return MemorySender(channel, queue), MemoryReceiver(channel, queue)
