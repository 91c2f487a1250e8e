"""Replicated state: components with apply(op) and digest(), one op table
(docs/architecture.md: The Step stream and the replica; Replica rules)."""

from engine.replica.base import Component, Effect, Replica, ReplicaError, StepOrderError, TokenChain
from engine.replica.components import PageTables, PrefixCachePages, SlotSampling, rank_replica
from engine.replica.host import HostTier

__all__ = [
    "Component",
    "Effect",
    "HostTier",
    "PageTables",
    "PrefixCachePages",
    "Replica",
    "ReplicaError",
    "SlotSampling",
    "StepOrderError",
    "TokenChain",
    "rank_replica",
]
