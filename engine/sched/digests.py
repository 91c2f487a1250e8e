"""Digest tracking: is every rank still an exact replica of the scheduler's mirror?

At a DigestCheck step the scheduler records its mirror's digest; every rank reports its
own replica's digest and a hash chain of every token it sampled. A rank whose digest
differs from the mirror, or whose token chain differs from rank 0's tokens (which the
scheduler chains itself as they arrive), stops the engine with a message naming the rank
and the step. The scheduler also checks itself: at each check its live page tables and
its radix tree must equal its mirror (so scheduler bugs are caught, not only transport).
"""

from __future__ import annotations

from engine.replica import TokenChain


class DigestMismatch(RuntimeError):
    """A replica diverged: fatal by design."""


class DigestTracker:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.expected: dict[int, tuple[str, str | None]] = {}  # seq -> (mirror digest, rank-0 token chain)
        self.reports: dict[int, int] = {}
        self.early: dict[int, list[tuple[int, str | None]]] = {}  # token chains reported before rank 0's tokens
        self._chain = TokenChain()  # rank 0's sampled tokens, in step order

    def expect(self, seq: int, digest: str) -> None:
        self.expected[seq] = (digest, None)

    def on_tokens(self, seq: int, token_bytes: bytes) -> None:
        """Rank 0's sampled tokens of step `seq` (every step, in order)."""
        self._chain.update(token_bytes)
        if seq in self.expected:
            digest, _ = self.expected[seq]
            self.expected[seq] = (digest, self._chain.hexdigest())
            for rank, chain in self.early.pop(seq, []):
                self._check_tokens(seq, rank, chain)

    def on_report(self, seq: int, rank: int, digest: str | None, tokens_hash: str | None) -> None:
        if digest is None:
            if seq in self.expected:
                raise DigestMismatch(f"rank {rank} sent no digest for step {seq}, which asked for one")
            return
        want = self.expected.get(seq)
        if want is None:
            raise DigestMismatch(f"rank {rank} reported a digest for step {seq}, which asked for none")
        if want[0] != digest:
            raise DigestMismatch(f"rank {rank} diverged at or before step {seq}: replica {digest} != {want[0]}")
        if want[1] is None:
            self.early.setdefault(seq, []).append((rank, tokens_hash))
        else:
            self._check_tokens(seq, rank, tokens_hash)
        self.reports[seq] = self.reports.get(seq, 0) + 1

    def _check_tokens(self, seq: int, rank: int, chain: str | None) -> None:
        want = self.expected[seq][1]
        if chain != want:
            raise DigestMismatch(f"rank {rank} sampled different tokens at or before step {seq}: {chain} != {want}")

    def forget_done(self, seq: int) -> None:
        """Every rank finished step `seq`: drop what it needed."""
        if self.reports.get(seq) == self.num_ranks:
            del self.expected[seq], self.reports[seq]
