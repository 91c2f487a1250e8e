"""The replica: replicated state built from components, changed only by Step ops.

Every process that follows the Step stream (the scheduler's mirror, every worker, the
coming cache controller) holds a `Replica` of the same components and applies the same
ops through the same op table, so `digest()` compares like with like (docs/architecture.md, Replica rules).

    replica = Replica([PageTables(), SlotSampling(), PrefixCachePages()], effects=[sampler])
    replica.apply_step(step)          # seq order checked; each op -> its handlers
    replica.digest()                  # SHA-256 over every component's canonical bytes

Components hold state that is digested; effects act on ops without being digested (a
worker's device tensors: the sampler's per-slot parameters), and run after the
components, so an op a component refuses never reaches the device.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, get_args

from msgs.steps import DigestCheck, Op, Step

OP_TYPES: tuple[type, ...] = get_args(Op)


class ReplicaError(RuntimeError):
    """An op that cannot apply to this replica: a protocol bug, always fatal."""


class StepOrderError(ReplicaError):
    """A Step out of order: one was lost or repeated. Never continue silently."""


class Component(ABC):
    """A piece of replicated state.

    Contract: `apply(op)` is a pure function of the op and this component's state (no
    clock, no randomness, no I/O, no dependence on hash or arrival order); an op that
    does not fit the state (an unknown or busy slot, a page not held) raises ReplicaError
    rather than inventing a default. `encode()` is a canonical byte encoding of the whole
    state: equal states, equal bytes, in every process.
    """

    name: ClassVar[str]
    ops: ClassVar[tuple[type, ...]]  # the op types this component applies

    @abstractmethod
    def apply(self, op: Any) -> None: ...

    @abstractmethod
    def encode(self) -> bytes: ...


class Effect(ABC):
    """Something a replica drives from ops but does not digest (device-side state derived
    from replicated state). Same purity contract as a Component."""

    ops: ClassVar[tuple[type, ...]]

    @abstractmethod
    def apply(self, op: Any) -> None: ...


class TokenChain:
    """SHA-256 chain over every token a rank sampled, as the packed int32 bytes of each
    StepDone, in step order: equal chains, equal tokens."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, token_bytes: bytes) -> None:
        self._h.update(token_bytes)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Replica:
    def __init__(self, components: Sequence[Component], effects: Sequence[Effect] = ()) -> None:
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate component names: {names}")
        self.components = {c.name: c for c in components}
        self.seq = 0
        self.table: dict[type, list[Callable[[Any], None]]] = {t: [] for t in OP_TYPES}
        self.table[DigestCheck].append(lambda _op: None)  # answered by whoever runs the step
        for part in (*components, *effects):
            for op_type in part.ops:
                if op_type not in self.table:
                    raise ValueError(f"{type(part).__name__} handles {op_type.__name__}, which is not an Op")
                self.table[op_type].append(part.apply)
        missing = [t.__name__ for t, handlers in self.table.items() if not handlers]
        if missing:  # an op nobody applies would be a silent no-op: refuse to build
            raise ValueError(f"no component applies {', '.join(missing)}")

    def add_effect(self, effect: Effect) -> None:
        """Follow ops with one more effect (after those already registered)."""
        for op_type in effect.ops:
            if op_type not in self.table:
                raise ValueError(f"{type(effect).__name__} handles {op_type.__name__}, which is not an Op")
            self.table[op_type].append(effect.apply)

    def __getitem__(self, name: str) -> Any:
        return self.components[name]

    def apply(self, op: Op) -> None:
        handlers = self.table.get(type(op))
        if handlers is None:
            raise ReplicaError(f"unknown op {type(op).__name__}")
        for handle in handlers:
            handle(op)

    def apply_step(self, step: Step) -> bool:
        """Apply a Step's ops in seq order; True when it asks for a digest."""
        if step.seq != self.seq + 1:
            raise StepOrderError(f"expected step {self.seq + 1}, got {step.seq}")
        self.seq = step.seq
        check = False
        for op in step.ops:
            self.apply(op)
            check = check or isinstance(op, DigestCheck)
        return check

    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.components):
            body = self.components[name].encode()
            h.update(name.encode() + b"\0" + len(body).to_bytes(8, "little"))
            h.update(body)
        return h.hexdigest()
