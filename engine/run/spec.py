"""Speculative decoding on a rank (docs/architecture.md, Speculative decoding): the draft
model's proposals (STANDALONE self-draft), the verify rows' logit positions, and acceptance.

Acceptance is one rule for greedy and sampled rows: the target's token at each logit
position is drawn exactly as a one-token step would draw it (the sampler's noise is a
function of the request's seed and the token's position), and a draft is accepted while it
equals that token; the first token that differs (or the one after the last draft) is the
bonus. For greedy rows that is the longest prefix equal to the target's argmax. For sampled
rows it is exact rejection sampling of a deterministic draft (a point mass q = 1 on d):
the Gumbel race picks d with probability p(d) (accept), and given that it did not, its
winner is distributed as p without d, renormalized: the residual (p - q)+ / (1 - p(d)).
So the output distribution is the target's, and a request's tokens are the ones it would
get without speculation whenever the logits are the same bit for bit. Draft trees (a node
accepted iff it equals its parent's draw; the longest path) are in engine/run/spec_tree.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from engine.layers.context import ForwardContext
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.parallel import lm_logits
from engine.replica import ReplicaError
from engine.run import prompt_scores
from engine.run.sampler import SampleResult
from engine.run.spec_tree import (
    accept_tree,
    chain_part,
    compact,
    depths,
    fill_leaves,
    leaf_alts,
    paths,
    tree_batch,
    tree_parents,
)
from models.llama import residual_stream
from msgs.codec import unpack_ids
from msgs.steps import Forward, PromptRows

log = structlog.get_logger()


@dataclass(frozen=True)
class VerifiedResult(SampleResult):
    """A verify step's answer: every logit row's draw (request-major; the logprob tensors the
    same rows), `keep` (int32, 1 for the answered rows: the accepted drafts, then the bonus) and,
    per sampled request, how many drafts it accepted. Fixed shapes on the device: selecting
    the answered rows there would sync the step (a boolean index), so the host does it
    (`answered`) once the step's results are home."""

    accepted: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def answered(self) -> VerifiedResult:
        """The answered rows only (a host sync when on the device)."""
        if self.keep is None:
            return self
        keep = self.keep.bool()

        def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[keep]

        return VerifiedResult(self.token_ids[keep], rows_of(self.logprobs), rows_of(self.top_ids),
                              rows_of(self.top_logprobs), accepted=self.accepted)


@dataclass
class VerifyRows:
    """The sampled requests of a verify step: their drafts and where their logits are."""

    num_drafts: list[int]  # per sampled request
    drafts: list[list[int]]  # per sampled request, resolved (no -1 left)
    row_drafts: list[int]  # per row of the forward (Drafts.num_drafts)
    chained: list[int] | None = None  # per sampled request (Drafts.chained), None: none chained
    parents: list[list[int]] | None = None  # per sampled request, a draft tree's (a chain's: i - 1); None: all chains
    kv_slots: list[list[int]] | None = None  # with parents: each sampled row's KV slots, its first token's on

    @property
    def logit_rows(self) -> list[int]:
        return [k + 1 for k in self.num_drafts]


class SelfDraft:
    """The target's first `layers` layers, its final norm and its LM head: a draft model
    that needs no weights and no KV of its own. Its layers are the target's, fed the same
    tokens at the same positions, so the K/V they write are what the target's first layers
    write: it reads the target's KV pool and its own writes are overwritten by the verify
    forward (values equal up to the rounding of another batch shape)."""

    follows = False  # the target's forward writes its KV: nothing to run after a replay

    def __init__(self, model: torch.nn.Module, layers: int, kv, backend) -> None:  # noqa: ANN001
        from models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
            raise ValueError(f"--speculative-draft-layers: a self-draft needs a Llama-family model, not "
                             f"{type(model).__name__}")
        total = len(model.model.layers)
        if not 1 <= layers < total:
            raise ValueError(f"--speculative-draft-layers {layers}: must be in 1..{total - 1} (the model has "
                             f"{total} layers)")
        self.model = model
        self.layers = layers
        self.kv = kv
        self.backend = backend

    def follow(self, batch: ForwardBatch) -> None:
        """Nothing: the target's forward wrote this draft's KV."""

    def step(self, tokens: torch.Tensor | list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One draft step: float32 logits of each decode row (token at position through table)."""
        n = len(positions)
        return self(ForwardBatch.build(tokens, positions, [1] * n, tables, [1] * n, self.kv.page_size,
                                       self.kv.device))

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """LlamaForCausalLM.forward over the first `layers` layers: float32 logits at
        batch.logit_indices."""
        self.backend.prepare(batch)
        kv, backend, m = self.kv, self.backend, self.model
        x = m.model.embed_tokens(batch.input_ids)
        ctx = ForwardContext(batch, kv, backend, m.rotary, m.rotary.prepare(batch.positions, x.dtype))
        residual = None
        for layer in m.model.layers[: self.layers]:
            x, residual = layer(x, residual, ctx)
        idx = batch.logit_indices
        h = m.model.norm(residual_stream(x, residual)[idx])  # the last layer run may have begun the next's norm
        head = m.model.embed_tokens if m.lm_head is None else m.lm_head
        return lm_logits(h, head.weight, m.config.vocab_size, head.packed)


class DraftModel:
    """A separate draft model with the target's vocabulary (--speculative-draft-model-path):
    its own weights and its own KV pool, indexed by the target's pages (one page table serves
    both), written by every forward the target runs (`follow`: prefill chunks, decode and
    verify rows), so its KV covers every token the target's does. Its attention backend is the
    kind the target's would be for its layout; where that can be captured, the model gets decode
    CUDA graphs of its own (`capture`): its draft steps and the rows it follows after a replay of
    the target's graphs replay them."""

    follows = True

    def __init__(self, path: str, target_vocab: int, num_pages: int, page_size: int, max_batch: int,
                 max_pages_per_req: int, dtype: torch.dtype, device: torch.device,
                 backend_name: Callable[[KVLayout], str] = lambda layout: "torch", load_format: str = "auto") -> None:
        from engine.layers.attention import create_backend
        from engine.run.dist import rank_config
        from models.registry import kv_layout, load_model

        self.model, mcfg = load_model(path, load_format, dtype, device, progress=False)  # dummy: as the target
        if mcfg.vocab_size != target_vocab:
            raise ValueError(f"--speculative-draft-model-path {path}: its vocabulary has {mcfg.vocab_size} tokens, "
                             f"the model's {target_vocab}: a draft must share the tokenizer")
        shard = rank_config(mcfg)
        layout = kv_layout(shard)
        self.kv = KVPool.from_layout(layout, mcfg.num_layers, num_pages, page_size, dtype, device)
        self.backend = create_backend(backend_name(layout), device)
        self.backend.bind(num_q_heads=shard.num_heads, kv_pool=self.kv, max_batch=max_batch,
                          max_pages_per_req=max_pages_per_req, q_dtype=dtype)
        self.graphs: Any = None  # engine/run/cuda_graph.CudaGraphRunner once captured

    def capture(self, rows: int) -> None:
        """Decode CUDA graphs of this model, up to `rows` rows (the target's)."""
        from engine.run.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.model, self.kv, self.backend, rows, self.kv.device)
        self.graphs.capture()

    def _fits(self, rows: int) -> bool:
        return self.graphs is not None and rows <= self.graphs.max_batch

    @torch.inference_mode()
    def follow(self, batch: ForwardBatch, replayed: bool = False) -> None:
        """Write this draft's KV for the target's batch (its logits are not needed): after a
        replay of the target's graphs by a replay of its own (every token a decode row, as a
        verify row's), else eagerly."""
        if replayed and self._fits(len(batch.positions)):
            starts, lens = batch.start_pos_cpu, batch.extend_lens_cpu
            assert batch.page_table_cpu is not None
            tables = [batch.page_table_cpu[i].tolist() for i in range(len(lens))]
            n = sum(lens)
            positions = [s + j for s, m in zip(starts, lens, strict=True) for j in range(m)]
            self.graphs.run_decode([0] * n, [0] * n, positions,
                                   [t for t, m in zip(tables, lens, strict=True) for _ in range(m)], None,
                                   device_ids=batch.input_ids)
            return
        idx = batch.logit_indices
        batch.logit_indices = idx[:0]
        try:
            self(batch)
        finally:
            batch.logit_indices = idx

    def step(self, tokens: torch.Tensor | list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One draft step: float32 logits of each decode row (token at position through table)."""
        n = len(positions)
        if self._fits(n):
            dev = tokens if isinstance(tokens, torch.Tensor) else _to_device(torch.tensor(tokens, dtype=torch.int64),
                                                                               self.kv.device)
            return self.graphs.run_decode([0] * n, [0] * n, positions, tables, None, device_ids=dev)
        return self(ForwardBatch.build(tokens, positions, [1] * n, tables, [1] * n, self.kv.page_size, self.kv.device))

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.prepare(batch)
        return self.model(batch, self.kv, self.backend)


class Speculator:
    """A rank's part of speculative decoding: fills worker drafts, lays out verify logits,
    decides acceptance. Stateless between steps: everything follows from the Step."""

    def __init__(self, draft: SelfDraft | DraftModel | Any, page_size: int, device: torch.device,
                 trees: bool = False) -> None:
        self.draft = draft
        self.trees = trees  # draft trees verified (--speculative-eagle-topk > 1, the torch backend; spec_tree.py)
        self.page_size = page_size
        self.device = device
        # per slot: its last verify row answered every draft (what a chained row counts on)
        self.all_accepted: torch.Tensor | None = None
        self.replayed = 0  # verify steps that replayed the decode CUDA graphs
        self.eager_reasons: set[str] = set()  # why verify steps did not (logged once per kind)

    def follow(self, batch: ForwardBatch) -> None:
        """After every target forward: a separate draft model writes its KV for the same batch."""
        if self.draft is not None:
            self.draft.follow(batch)

    def follow_replay(self, graphs: Any, starts: list[int], lens: list[int], tables: list[list[int]],
                      sample: list[int]) -> None:
        """After a replay of the decode graphs over these rows (their tokens, resolved, in
        `graphs.input_ids`, request-major: plain decode rows or a chain's verify rows), a draft
        that follows the target runs over the same tokens, in stream order: by a replay of its
        own graphs where it has them, else eagerly."""
        if getattr(self.draft, "follows", False):
            batch = ForwardBatch.build(graphs.input_ids[: sum(lens)], starts, lens, tables, sample, self.page_size,
                                       self.device)
            self.draft.follow(batch, replayed=True)

    def rows(self, fwd: Forward, ids: list[int], tables: list[list[int]],
             last_token: torch.Tensor | None = None) -> VerifyRows:
        """The verify rows of `fwd` (its drafts resolved: the draft model's filled into `ids`; a
        chained row's first token, a future reference, read from `last_token` by its slot)."""
        assert fwd.drafts is not None
        num = unpack_ids(fwd.drafts.num_drafts)
        lens, starts, sample = unpack_ids(fwd.extend_lens), unpack_ids(fwd.start_pos), unpack_ids(fwd.sample)
        if len(num) != len(lens) or any(k and (not s or k >= n) for k, s, n in zip(num, sample, lens, strict=True)):
            raise ReplicaError(f"bad Drafts: {num} drafts for rows of {lens} tokens (sample {sample})")
        ends = [sum(lens[: i + 1]) for i in range(len(lens))]
        chained = unpack_ids(fwd.drafts.chained) if fwd.drafts.chained else None
        parents = tree_parents(fwd, num, chained, self.trees)  # None: chains (engine/run/spec_tree.py)
        # a head (EAGLE/EAGLE3/NEXTN, engine/run/eagle.py) fills the -1 drafts the scheduler sends for it
        if fwd.drafts.on_worker:
            first = self._first_tokens(ids, num, ends, unpack_ids(fwd.slots), chained, last_token)
            self._fill(ids, num, ends, starts, lens, tables, parents, first)
        elif any(ids[e - k + j] < 0 for k, e in zip(num, ends, strict=True) for j in range(k)):
            raise ReplicaError("a scheduler's draft is a future reference (-1) without on_worker")
        drafts = [ids[e - k : e] for k, e, s in zip(num, ends, sample, strict=True) if s]
        if chained is not None and (len(chained) != len(num) or any(c and not s for c, s in zip(chained, sample,
                                                                                                  strict=True))):
            raise ReplicaError(f"bad Drafts.chained {chained} for rows sampling {sample}")
        return VerifyRows([k for k, s in zip(num, sample, strict=True) if s], drafts, num,
                          [c for c, s in zip(chained, sample, strict=True) if s] if chained else None,
                          parents=[p for p, s in zip(parents, sample, strict=True) if s] if parents else None)

    def _first_tokens(self, ids: list[int], num: list[int], ends: list[int], slots: list[int],
                      chained: list[int] | None, last_token: torch.Tensor | None) -> torch.Tensor | None:
        """The drafting rows' first tokens on the device where one is a future reference (a row
        chained on the row in flight: its bonus, `last_token[slot]` once that row's sampling has
        run, in stream order); None when all are known on the host."""
        rows = [i for i, k in enumerate(num) if k]
        first = [ids[ends[i] - num[i] - 1] for i in rows]
        for i, t in zip(rows, first, strict=True):
            if t < 0 and not (chained and chained[i]):
                raise ReplicaError(f"row {i}: worker drafts need a known first token or a chained row")
            if any(x != -1 for x in ids[ends[i] - num[i] : ends[i]]):
                raise ReplicaError(f"row {i}: worker drafts need -1 placeholders")
        if min(first, default=0) >= 0:
            return None
        if last_token is None:
            raise ReplicaError("a chained row's first token is a future reference, but no last tokens were given")
        host = _to_device(torch.tensor(first, dtype=torch.int64), self.device)
        at = _to_device(torch.tensor([slots[i] for i in rows], dtype=torch.int64), self.device)
        return torch.where(host < 0, last_token[at], host)

    def _fill(self, ids: list[int], num: list[int], ends: list[int], starts: list[int], lens: list[int],
              tables: list[list[int]], parents: list[list[int]] | None = None,
              first: torch.Tensor | None = None) -> None:
        """The draft model proposes each -1 draft greedily, one position a forward for every
        drafting row at once, from the row's first token (`first`: all drafting rows' on the
        device, where a chained row's is a future reference; else read from `ids`).
        A tree row (a chain with leaves, `parents`): the chain so, each leaf the draft's next best
        token at its position (engine/run/spec_tree.py: fill_leaves)."""
        if self.draft is None:
            raise ReplicaError("a Step asks for worker drafts, but this rank has no draft model")
        rows = [i for i, k in enumerate(num) if k]
        chain = [chain_part(parents[i]) if parents else k for i, k in enumerate(num)]  # drafts in the chain
        alts = leaf_alts(parents) if parents else 1
        propose = getattr(self.draft, "propose", None)
        if propose is not None:  # a head fed the target's hidden states (engine/run/eagle.py)
            spec = [(ends[i] - num[i] - 1, chain[i], starts[i] + lens[i] - num[i] - 1, tables[i]) for i in rows]
            top = propose(ids, spec, alts, first)
        else:  # a draft model (separate, or the self-draft)
            def step(j: int, act: list[int], tokens: torch.Tensor | list[int],
                     keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
                logits = self.draft.step(tokens, [starts[rows[r]] + lens[rows[r]] - num[rows[r]] - 1 + j for r in act],
                                         [tables[rows[r]] for r in act])
                return logits.argmax(dim=-1), logits.topk(alts, dim=-1).indices if alts > 1 else None

            top = chain_drafts(ids, [ends[i] - num[i] - 1 for i in rows], [chain[i] for i in rows], first,
                               self.device, step)
        if parents:
            fill_leaves(ids, [(ends[i] - num[i] - 1, parents[i], top[r]) for r, i in enumerate(rows)])

    def forward(self, runner: Any, fwd: Forward, ids: list[int], slots: list[int], starts: list[int],
                lens: list[int], sample: list[int], tables: list[list[int]]
                ) -> tuple[torch.Tensor, list[int], list[int], VerifyRows, list[int]] | None:
        """A verify step on `runner` (the ModelRunner): the drafts resolved (the draft model's
        filled in), one forward over every row, logits at each sampled row's last num_drafts + 1.
        Returns the logits, each logit row's slot and sampled position, the rows, the sampled
        requests' slots (None when no row samples)."""
        v = self.rows(fwd, ids, tables, runner.last_token)
        # grammar helpers fill the drafted positions' masks while the forward runs
        runner.grammar.drafting([s for s, smp in zip(slots, sample, strict=True) if smp], v.drafts)
        # rows scoring their prompt (prompt_scores.py) take every token's logits: a prefill-shaped forward
        logits = None if fwd.prompt is not None else self._replay(runner, ids, slots, starts, lens, sample, tables, v)
        if logits is None:
            logits = self._eager(runner, ids, slots, starts, lens, sample, tables, v, fwd.prompt)
        req = [(s, st + n - k - 1) for s, st, n, smp, k in zip(slots, starts, lens, sample, v.row_drafts, strict=True)
               if smp]
        if not req:
            return None
        row_slots = [s for (s, _), n in zip(req, v.logit_rows, strict=True) for _ in range(n)]
        positions = [p + 1 + i for (_, p), n in zip(req, v.logit_rows, strict=True) for i in range(n)]
        if v.parents is not None:  # a tree node's token is drawn at its depth's position
            positions = [p + 1 + d for (_, p), par in zip(req, v.parents, strict=True) for d in depths(par)]
        return logits, row_slots, positions, v, [s for s, _ in req]

    def _replay(self, runner: Any, ids: list[int], slots: list[int], starts: list[int], lens: list[int],
                sample: list[int], tables: list[list[int]], v: VerifyRows) -> torch.Tensor | None:
        """A chain verify step as one replay of the decode CUDA graphs (None: it cannot be): row
        i's n tokens are n decode rows at positions starts[i] .. starts[i] + n - 1 over its page
        table. Each layer writes every row's K/V before it attends, and a decode row attends up
        to its own position, so the rows see exactly a chain's causal prefix; their logits are
        all the row's logit rows (n = drafts + 1). The cost against a prefill-shaped verify: the
        row's KV is read n times instead of once, small where speculation pays (batch 1-8)."""
        g = runner.graphs
        if g is None or v.parents is not None:
            return None
        why = ("a row that does not sample" if not all(sample) else
               "more rows than the largest graph" if sum(lens) > g.max_batch else
               "a row that is not its drafts + 1" if any(n != k + 1 for n, k in zip(lens, v.row_drafts, strict=True))
               else "")
        if why:
            if why not in self.eager_reasons:  # once per kind: a diagnostic, not a hot-path log
                self.eager_reasons.add(why)
                log.info("verify step eager", reason=why, rows=sum(lens), graph_rows=g.max_batch)
            return None
        rows = [(s, st + j, t) for s, st, n, t in zip(slots, starts, lens, tables, strict=True) for j in range(n)]
        self.replayed += 1
        logits = g.run_decode(ids, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], runner.last_token)
        self.follow_replay(g, starts, lens, tables, sample)
        return logits

    def _eager(self, runner: Any, ids: list[int], slots: list[int], starts: list[int], lens: list[int],
               sample: list[int], tables: list[list[int]], v: VerifyRows, prompt: PromptRows | None = None
               ) -> torch.Tensor:
        """The verify forward as a prefill-shaped batch (trees, mixed steps, drafts that follow, rows
        scoring their prompt: their scores into runner.scores, as ModelRunner._forward's)."""
        batch = ForwardBatch.build(runner.resolve_ids(ids, slots, lens), starts, lens, tables, sample,
                                   self.page_size, self.device)
        # each sampled row's last num_drafts + 1 tokens, every token of a row scoring its prompt
        scored, widths = unpack_ids(prompt.rows) if prompt is not None else [], self.widths(sample, v)
        rows = prompt_scores.token_rows(lens, sample, scored, widths)
        batch.logit_indices = _to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        if v.parents is not None:  # depths as positions, the tree mask (engine/run/spec_tree.py)
            followers = (self.draft.backend,) if isinstance(self.draft, DraftModel) else ()
            v.kv_slots = tree_batch(runner, batch, v, slots, starts, lens, sample, tables, self.page_size, followers)
        runner.backend.prepare(batch)
        logits = runner.model(batch, runner.kv, runner.backend)
        self.follow(batch)
        if prompt is not None:
            scoring = prompt_scores.split(ids, lens, sample, scored, unpack_ids(prompt.next_ids), widths)
            if runner.rank == 0:  # (only rank 0 answers; logits are the same on every rank)
                runner.scores = prompt_scores.score(logits, scoring, prompt.top_k)
            logits = logits.index_select(0, _to_device(torch.tensor(scoring.sampled, dtype=torch.int64), self.device))
        return logits

    def sample(self, runner: Any, logits: torch.Tensor, row_slots: list[int], positions: list[int], v: VerifyRows,
               req_slots: list[int]) -> VerifiedResult:
        """Every logit row drawn with its penalty history (the slot's and the drafts before the
        row) and masked by its grammar after them, the drafts accepted, `last_token` set to each
        bonus; only answered tokens enter the penalty history and the grammar matchers."""
        grammar, sampler = runner.grammar, runner.sampler
        constrained = grammar.constrained(req_slots)
        if constrained and not grammar.verifies_drafts:  # (in-process matchers on CUDA): drafts rejected
            v = dataclasses.replace(v, drafts=[[] if s in grammar.matchers else d
                                               for s, d in zip(req_slots, v.drafts, strict=True)])
        grammar.mask(logits, row_slots, dict(zip(req_slots, v.drafts, strict=True)) if constrained else None)
        prior = [d[:i] for d, n in zip(v.drafts, v.logit_rows, strict=True) for i in range(n)]
        if v.parents is not None:  # a tree node's history: the drafts on its path
            prior = [p for d, par in zip(v.drafts, v.parents, strict=True) for p in paths(d, par)]
        req_dev = _to_device(torch.tensor(req_slots, dtype=torch.int64), self.device)
        valid = self._valid(v, req_dev, runner.last_token.shape[0])
        drawn = sampler.sample_verify(logits, row_slots, positions, prior)
        if v.parents is not None:
            keep, accepted, bonus, path = accept_tree(drawn, v, valid)
            res = _answered(drawn, keep, accepted)
            pools, by_slot = self._stores(runner)
            compact(pools, v, path, accepted, by_slot)
        else:
            res, bonus = self.accept(drawn, v, valid)
        if valid is not None:  # a void row keeps the slot's last token (its previous row's bonus)
            bonus = torch.where(valid, bonus, runner.last_token[req_dev])
        assert self.all_accepted is not None and res.accepted is not None
        nums = _to_device(torch.tensor(v.num_drafts, dtype=torch.int64), self.device)
        self.all_accepted.index_copy_(0, req_dev, res.accepted == nums)
        runner.last_token.index_copy_(0, req_dev, bonus)
        if sampler.tracks_history or constrained:  # (host syncs: answered rows are data-dependent)
            answered = req_dev.repeat_interleave(res.accepted + 1)  # type: ignore[operator]
            tokens = res.answered().token_ids
            sampler.record(answered, tokens)
            if constrained:  # the matchers advance by the answered tokens only
                grammar.sampled(answered.tolist(), tokens)
        return res

    def _stores(self, runner: Any) -> tuple[list[KVPool], tuple[torch.Tensor, ...]]:
        """What a tree's accepted path is compacted in: the target's KV pool, a draft's own (a
        separate draft model's, a head's) and a head's hidden pool (indexed by slot)."""
        pools = [runner.kv]
        own = getattr(self.draft, "kv", None)
        if isinstance(own, KVPool) and own is not runner.kv:  # (a self-draft's is the target's)
            pools.append(own)
        hidden = getattr(self.draft, "hidden", None)
        return pools, (hidden,) if isinstance(hidden, torch.Tensor) else ()

    @staticmethod
    def widths(sample: list[int], v: VerifyRows) -> list[int]:
        """Each row's logit rows in a verify step: a sampled row's num_drafts + 1, else none."""
        drafts = iter(v.num_drafts)
        return [next(drafts) + 1 if s else 0 for s in sample]

    def _valid(self, v: VerifyRows, req_dev: torch.Tensor, slots: int) -> torch.Tensor | None:
        """Per sampled request: whether its row counts (a chained row only if its slot's previous
        verify row, run just before it, accepted every draft); None when no row is chained.
        On the device: the scheduler learns it from the answer (accepted -1), never waited for."""
        if self.all_accepted is None:
            self.all_accepted = torch.ones(slots, dtype=torch.bool, device=self.device)
        if v.chained is None:
            return None
        chained = _to_device(torch.tensor(v.chained, dtype=torch.bool), self.device)
        return ~chained | self.all_accepted[req_dev]

    def accept(self, res: SampleResult, v: VerifyRows,
               valid: torch.Tensor | None = None) -> tuple[VerifiedResult, torch.Tensor]:
        """The answered tokens (accepted drafts, then the bonus) of each row, and each row's
        last answered token (the next step's input). A row not `valid` answers nothing
        (accepted -1)."""
        rows = v.logit_rows
        dev = res.token_ids.device
        b, width = len(rows), max(rows)
        req = _to_device(torch.repeat_interleave(torch.arange(b), torch.tensor(rows)), dev)
        col = _to_device(torch.cat([torch.arange(n) for n in rows]), dev)
        target = torch.full((b, width), -1, dtype=torch.int64, device=dev)
        target[req, col] = res.token_ids
        drafts = torch.full((b, width), -2, dtype=torch.int64)  # -2 pads: never a token, never -1
        for i, d in enumerate(v.drafts):
            drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        match = target[:, :-1] == _to_device(drafts[:, :-1], dev) if width > 1 else target[:, :0] == 0
        accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # the longest matching prefix
        bonus = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
        if valid is not None:
            accepted = torch.where(valid, accepted, -1)
        return _answered(res, col <= accepted[req], accepted), bonus


DraftStep = Callable[[int, list[int], torch.Tensor | list[int], torch.Tensor | None],
                     tuple[torch.Tensor, torch.Tensor | None]]


def chain_drafts(ids: list[int], firsts: list[int], lengths: list[int], first: torch.Tensor | None,
                 device: torch.device, step: DraftStep) -> list[list[list[int]]]:
    """Greedy chains of drafts, written into `ids` after each row's first token (ids[firsts[r]],
    or first[r] on the device where given: a chained row's is a future reference), lengths[r]
    drafts for row r. step(j, act, tokens, keep) runs the draft at chain position j for rows
    `act` (keep: each one's index among the previous step's rows; None at j = 0) and returns their
    drafts (target ids) and, for a tree's leaves, their alternatives. Each step's drafts feed the
    next on the device; the host reads them all once, at the end. Returns, per row, the
    alternatives of each step (empty without them)."""
    prev: list[int] = []
    drafted: torch.Tensor | None = None
    steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (rows, drafts, alternatives)
    for j in range(max(lengths, default=0)):
        act = [r for r, n in enumerate(lengths) if n > j]
        keep = None
        tokens: torch.Tensor | list[int]
        if drafted is not None:
            keep = _to_device(torch.tensor([prev.index(r) for r in act], dtype=torch.int64), device)
            tokens = drafted[keep]
        elif first is not None:
            tokens = first[_to_device(torch.tensor(act, dtype=torch.int64), device)]
        else:
            tokens = [ids[firsts[r]] for r in act]
        drafted, alt = step(j, act, tokens, keep)
        steps.append((act, drafted, alt))
        prev = act
    top: list[list[list[int]]] = [[] for _ in lengths]
    for j, (act, got, alt) in enumerate(steps):  # the host reads: one sync for all steps
        for r, t in zip(act, got.tolist(), strict=True):
            ids[firsts[r] + j + 1] = int(t)
        if alt is not None:
            for r, c in zip(act, alt.tolist(), strict=True):
                top[r].append(c)
    return top


def _answered(res: SampleResult, keep: torch.Tensor, accepted: torch.Tensor) -> VerifiedResult:
    """A verify step's draws with the answered ones marked (`keep`, bool over the logit rows)."""
    return VerifiedResult(res.token_ids, res.logprobs, res.top_ids, res.top_logprobs, accepted=accepted,
                          keep=keep.to(torch.int32))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync (as the runner's)."""
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)
