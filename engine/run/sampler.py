"""Batched token sampler run by the worker after the model's forward.

Contracts:
- Same code on CPU and CUDA. On CUDA `sample()` never reads device values on the host, so it never
  synchronises (as long as `slots` is a host list/CPU tensor or a device tensor, and
  `positions` is already on the device).
- Per-request work (validation, parameter upload, penalty bookkeeping allocation) happens once in
  `add()`. Per-batch-composition work (plan, gathered parameter rows) is cached by the tuple of
  slots and invalidated by `add()`/`remove()`.
- Seeded sampling: the token drawn for a row depends only on (seed, position, that row's logits and
  params), never on the rest of the batch or the step number. Noise is a counter-based splitmix64
  hash of (seed, position, token id) fed to the Gumbel-max trick.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import structlog
import torch
from torch import Tensor

from engine.layers import cpu_kernels, sampling_masks, triton_ops
from engine.run.bad_words import BadWords
from engine.run.noise import _GAMMA, _UNIFORM_BITS, _mix64, _mix64_int
from engine.run.ranking import canonical_topk, ranked_topk
from engine.run.sample_params import SampleParams
from engine.run.slot_rows import SlotRows

log = structlog.get_logger()

# When every sampled row has top_k <= this, filter on topk() candidates instead of a full sort.
_TOPK_CANDIDATES_MAX = 4096
# "sort" mode on a CPU: candidates tried before a row is sorted whole (`Sampler._race_by_rows`)
_SORT_FIRST = 1024
# Bounded cache of batch compositions; cleared whenever a request is added or removed.
_PLAN_CACHE_MAX = 16


@dataclass(frozen=True)
class SampleResult:
    """Output of `Sampler.sample`; every tensor stays on the sampler's device.

    token_ids: int64[B]. logprobs: float32[B], log_softmax of the RAW logits at the chosen token
    (before temperature, penalties and logit_bias; after a grammar's mask where the row has one, as
    vLLM reports them: a forced token's logprob is 0 and a masked one's -inf), present when any
    batch row asked for logprobs. top_ids/top_logprobs: [B, K] sorted descending,
    K = max top_logprobs over the batch (rows that asked for fewer slice their own prefix).
    """

    token_ids: Tensor
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None


# Rows of the per-slot parameter tables.
_F_INV_TEMP, _F_TOP_P, _F_LOG_MIN_P, _F_REP, _F_FREQ, _F_PRES = range(6)
_I_SEED, _I_TOP_K, _I_GREEDY, _I_MIN_END = range(4)


@dataclass(frozen=True)
class _Plan:
    """Host-side decisions for one batch composition (what work the step needs)."""

    all_greedy: bool
    any_greedy: bool
    any_repetition: bool
    any_freq_presence: bool
    any_bias: bool
    any_min: bool  # a row's min_new_tokens may mask its stop tokens
    any_allowed: bool  # a row samples among its allowed_token_ids only
    any_bad: bool  # a row has bad_words (their tokens masked after their prefixes)
    mode: str  # candidates for filtering: "none" (full vocab), "topk", "sort"
    kmax: int  # candidate count in "topk" mode
    use_top_k: bool
    use_top_p: bool
    whole_top_p: bool  # a sampled row has top_p without top_k: its mass is of the whole row
    use_min_p: bool
    want_logprobs: bool
    num_top: int

    @property
    def any_penalty(self) -> bool:
        return self.any_repetition or self.any_freq_presence

    @property
    def any_history(self) -> bool:
        """Whether the sampled tokens enter a history that later draws read."""
        return self.any_penalty or self.any_bad

    @property
    def argmax_only(self) -> bool:
        return self.all_greedy and not (self.any_penalty or self.any_bias or self.any_min or self.any_allowed
                                        or self.any_bad or self.want_logprobs)


class _Batch(NamedTuple):
    plan: _Plan
    slots: Tensor  # int64[B] on device
    fp: Tensor  # float32[6, B] gathered parameter rows
    ip: Tensor  # int64[4, B]


class Sampler:
    """Samples one token per row from [B, V] logits; per-request state lives in slot rows.

    On CUDA the race's noise is one triton launch over [B, C] (triton_ops.race_noise_: an eager
    hash of ~20 kernels took 0.53 ms at B=1 and 4.05 ms at B=256, V=152k, on an H100; the same
    arithmetic per element, so a row's noise does not depend on its batch). On a CPU it is one
    pass of C (cpu_kernels.race_noise_: 16 rows x 49k, 2 threads, 7.7 -> 1.4 ms); the torch ops of
    `_log_exp_noise` are the reference and the path where the C library does not build.
    """

    def __init__(self, vocab_size: int, max_slots: int, device: torch.device | str,
                 deterministic: bool = False) -> None:
        self.vocab_size = vocab_size
        # top_k / top_p candidates in one order (equal logits by id) whatever the batch's largest
        # top_k or candidate mode: what deterministic inference needs (`_candidates`)
        self.deterministic = deterministic
        self.max_slots = max_slots
        self.device = torch.device(device)
        self._params: list[SampleParams | None] = [None] * max_slots
        self._fp = torch.zeros(6, max_slots, dtype=torch.float32, device=self.device)
        self._ip = torch.zeros(4, max_slots, dtype=torch.int64, device=self.device)
        # (id + 1) * gamma for every token id: the per-token half of the noise counter.
        self._id_gamma = torch.arange(1, vocab_size + 1, device=self.device) * _GAMMA
        # Penalty bookkeeping, allocated on first use: most deployments never pay for it.
        self._seen: Tensor | None = None  # bool[S, V]: prompt | generated (repetition penalty)
        self._counts: Tensor | None = None  # float32[S, V]: generated counts (freq/presence)
        self._bias = SlotRows(max_slots, vocab_size, self.device, self._upload)  # logit_bias
        # min_new_tokens' stop ids with -inf, added while a row's position is below its _I_MIN_END
        self._min_stops = SlotRows(max_slots, vocab_size, self.device, self._upload)
        self._allowed = SlotRows(max_slots, vocab_size, self.device, self._upload)  # allowed_token_ids (1s)
        self._bad = BadWords(max_slots, self.device, self._upload)
        self._batches: dict[tuple[int, ...], _Batch] = {}  # by slot tuple
        self._active_plan: _Plan | None = None  # plan over all registered slots
        self._fused_noise = self.device.type == "cuda" and triton_ops.available()
        self._c_noise = self.device.type == "cpu" and cpu_kernels.library() is not None  # built once, here
        # "sort" mode by flashinfer's sort-free masks where no bit is promised (`_race_masked`)
        self._masks = not deterministic and sampling_masks.available(self.device)

    def warm(self) -> None:
        """Compile the race's kernel in both modes (over candidate ids, over the whole vocabulary),
        and load the sort-free masks' module, before ready, whatever the warm-up batch happens to
        sample (engine/run/warmup.py)."""
        if self._fused_noise:
            z = torch.zeros(1, dtype=torch.int64, device=self.device)
            for ids in (None, torch.zeros(1, 8, dtype=torch.int64, device=self.device)):
                triton_ops.race_noise_(torch.zeros(1, 8, device=self.device), z, z, ids, _UNIFORM_BITS)
            ranked_topk(torch.zeros(1, 8, device=self.device), 2)  # the key kernel: top_logprobs in every mode
        if self._masks:
            try:
                sampling_masks.warm(self.device, self.vocab_size)
            except Exception as e:  # noqa: BLE001 - a module that does not build here: the sort, logged
                log.warning("flashinfer's top_k / top_p masks do not load: sort mode sorts", error=str(e)[-2000:])
                self._masks = False

    # ---- request lifecycle (once per request) ----

    def add(
        self,
        slot: int,
        params: SampleParams,
        prompt_ids: Sequence[int] | Tensor = (),
        output_ids: Sequence[int] | Tensor = (),
    ) -> None:
        """Register a request in a free slot. prompt_ids matter for repetition_penalty only;
        output_ids (tokens generated before a retraction) seed every penalty's history."""
        self._check_slot(slot)
        if self._params[slot] is not None:
            raise ValueError(f"slot {slot} is already in use")
        self._params[slot] = params
        self._fp[:, slot] = self._upload(_float_row(params), torch.float32)
        self._ip[:, slot] = self._upload(self._int_row(params, len(prompt_ids)), torch.int64)
        self._bias.set(slot, [t for t, _ in params.logit_bias], [v for _, v in params.logit_bias], "logit_bias")
        self._min_stops.set(slot, params.min_stop_ids, [-math.inf] * len(params.min_stop_ids), "min_stop_ids")
        self._allowed.set(slot, params.allowed_token_ids, [1.0] * len(params.allowed_token_ids), "allowed_token_ids")
        self._bad.set(slot, params.bad_words_ids, output_ids)
        if params.uses_repetition:
            self._init_seen(slot, prompt_ids)
            if len(output_ids):
                self._seen[slot].index_fill_(0, self._as_device(output_ids), True)
        if params.uses_freq_presence:
            self._init_counts(slot)
            if len(output_ids):
                ids = self._as_device(output_ids)
                self._counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self._invalidate()

    @property
    def active_slots(self) -> list[int]:
        """Slots with a registered request."""
        return [s for s, p in enumerate(self._params) if p is not None]

    def remove(self, slot: int) -> None:
        """Free a slot. Its device rows go stale; add() overwrites them on reuse."""
        self._check_slot(slot)
        if self._params[slot] is None:
            raise ValueError(f"slot {slot} is not in use")
        self._params[slot] = None
        self._invalidate()

    # ---- per step ----

    def sample(
        self, logits: Tensor, slots: Sequence[int] | Tensor, positions: Sequence[int] | Tensor
    ) -> SampleResult:
        """Pick one token per row and update the penalty state with it.

        logits: float[B, V] (V == vocab_size), not modified. slots: the row's slot, as a host
        list/CPU tensor (exact per-batch plan, cached by composition) or a device tensor (plan
        taken over all registered slots; no host read). positions: int64[B], the position of the
        token being sampled; with the seed it fully determines the noise. Call this only for rows
        whose token will be kept: it records the token for penalties.
        """
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [B, {self.vocab_size}], got {tuple(logits.shape)}")
        batch = self._batch(slots)
        if batch.plan.argmax_only:
            return SampleResult(token_ids=logits.argmax(dim=-1))
        logits, positions = logits.float(), self._as_device(positions)
        penalized = self._penalize(logits, batch, positions)
        tokens = self._choose(penalized, batch, positions)
        self._record(batch, tokens)
        return self._with_logprobs(logits, tokens, batch.plan)

    def sample_verify(
        self, logits: Tensor, slots: Sequence[int], positions: Sequence[int], prior: Sequence[Sequence[int]]
    ) -> SampleResult:
        """Speculative verify rows (engine/run/spec.py): pick one token per row as `sample` would
        for a request whose history also holds `prior[j]` (the drafts before row j), and record
        nothing: only the tokens the request answers enter its history (`record`)."""
        batch = self._batch(slots)
        if batch.plan.argmax_only:
            return SampleResult(token_ids=logits.argmax(dim=-1))
        logits, at = logits.float(), self._as_device(positions)
        history = self._prior(prior, batch.plan) if batch.plan.any_penalty else None
        recent = self._bad.verify_history(batch.slots, prior) if batch.plan.any_bad else None
        penalized = self._penalize(logits, batch, at, history, recent)
        tokens = self._choose(penalized, batch, at)
        return self._with_logprobs(logits, tokens, batch.plan)

    @property
    def tracks_history(self) -> bool:
        """Whether `record` has work: a registered request has a penalty or bad words."""
        if self._active_plan is None:
            self._active_plan = self._plan([p for p in self._params if p is not None])
        return self._active_plan.any_history

    def record(self, slots: Tensor, tokens: Tensor) -> None:
        """Add answered tokens (int64 device tensors, one slot per token, a slot's in order, repeats
        allowed) to their slots' penalty and bad_words histories."""
        if self.tracks_history:
            assert self._active_plan is not None
            self._record(_Batch(self._active_plan, slots, self._fp[:, slots], self._ip[:, slots]), tokens)

    def _prior(self, prior: Sequence[Sequence[int]], plan: _Plan) -> tuple[Tensor, Tensor]:
        """Per row: [R, V] bool of the prior tokens and [R, V] float32 of their counts."""
        rows = [j for j, ids in enumerate(prior) for _ in ids]
        ids = [t for p in prior for t in p]
        counts = torch.zeros(len(prior), self.vocab_size, device=self.device)
        if ids:
            idx = (self._upload(rows, torch.int64), self._upload(ids, torch.int64))
            counts.index_put_(idx, torch.ones(len(ids), device=self.device), accumulate=True)
        return counts > 0, counts

    def apply_penalties(self, logits: Tensor, slots: Sequence[int] | Tensor) -> Tensor:
        """Return logits with the slots' repetition/frequency/presence penalties applied."""
        return self._penalize(logits.float(), self._batch(slots), None)

    # ---- batch plans ----

    def _batch(self, slots: Sequence[int] | Tensor) -> _Batch:
        if isinstance(slots, Tensor) and slots.device.type != "cpu":
            # Reading a device tensor would sync, so plan for every registered request instead.
            if self._active_plan is None:
                self._active_plan = self._plan([p for p in self._params if p is not None])
            idx = slots.to(torch.int64)
            return _Batch(self._active_plan, idx, self._fp[:, idx], self._ip[:, idx])
        key = tuple(int(s) for s in (slots.tolist() if isinstance(slots, Tensor) else slots))
        batch = self._batches.get(key)
        return batch if batch is not None else self._build_batch(key)

    def _invalidate(self) -> None:
        self._batches.clear()
        self._active_plan = None

    def _build_batch(self, key: tuple[int, ...]) -> _Batch:
        params = []
        for s in key:
            self._check_slot(s)
            p = self._params[s]
            if p is None:
                raise ValueError(f"slot {s} is not in use")
            params.append(p)
        idx = self._upload(list(key), torch.int64)
        batch = _Batch(self._plan(params), idx, self._fp[:, idx], self._ip[:, idx])
        if len(self._batches) >= _PLAN_CACHE_MAX:
            self._batches.clear()
        self._batches[key] = batch
        return batch

    def _plan(self, params: list[SampleParams]) -> _Plan:
        sampled = [p for p in params if not p.greedy]
        ks = [p.top_k for p in sampled]
        use_top_k = any(k > 0 for k in ks)
        use_top_p = any(p.top_p < 1.0 for p in sampled)
        if sampled and all(0 < k <= _TOPK_CANDIDATES_MAX for k in ks):
            mode, kmax = "topk", min(max(ks), self.vocab_size)
        else:
            mode, kmax = ("sort" if use_top_k or use_top_p else "none"), 0
        return _Plan(
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            any_repetition=any(p.uses_repetition for p in params),
            any_freq_presence=any(p.uses_freq_presence for p in params),
            any_bias=any(p.logit_bias for p in params),
            any_min=any(p.min_stop_ids for p in params),
            any_allowed=any(p.allowed_token_ids for p in params),
            any_bad=any(p.bad_words_ids for p in params),
            mode=mode,
            kmax=kmax,
            use_top_k=use_top_k,
            use_top_p=use_top_p,
            whole_top_p=any(p.top_p < 1.0 and not 0 < p.top_k < self.vocab_size for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            want_logprobs=any(p.logprobs for p in params),
            num_top=min(max((p.top_logprobs for p in params), default=0), self.vocab_size),
        )

    # ---- logits processing ----

    def _penalize(self, logits: Tensor, batch: _Batch, positions: Tensor | None,
                  prior: tuple[Tensor, Tensor] | None = None, recent: Tensor | None = None) -> Tensor:
        """positions: the sampled tokens' (min_new_tokens; None skips it). prior: per row, tokens
        (and their counts) of the history beyond the slot's (verify rows); recent: per row, the last
        output tokens that bad_words match (verify rows: with the drafts; None: the slot's own)."""
        plan, out = batch.plan, logits
        if plan.any_allowed:  # first: a bias or penalty of a masked token leaves it at -inf
            out = self._allowed.keep_only(out, batch.slots)
        if plan.any_bad:
            out = self._bad.ban(out, batch.slots, self._bad.history(batch.slots) if recent is None else recent)
        if plan.any_bias:  # rows of slots without a bias add zeros
            out = self._bias.add_to(out, batch.slots)
        if plan.any_min and positions is not None:
            out = self._min_stops.add_to(out, batch.slots, (positions < batch.ip[_I_MIN_END]).unsqueeze(1))
        if plan.any_repetition and self._seen is not None:
            rep = batch.fp[_F_REP].unsqueeze(1)
            # HF semantics: positive logits are divided, negative multiplied (both lower them).
            scaled = torch.where(out > 0, out / rep, out * rep)
            seen = self._seen[batch.slots] if prior is None else self._seen[batch.slots] | prior[0]
            out = torch.where(seen, scaled, out)
        if plan.any_freq_presence and self._counts is not None:
            counts = self._counts[batch.slots] if prior is None else self._counts[batch.slots] + prior[1]
            presence = (counts > 0).to(out.dtype) * batch.fp[_F_PRES].unsqueeze(1)
            out = out - counts.mul_(batch.fp[_F_FREQ].unsqueeze(1)) - presence
        return out

    def _choose(self, penalized: Tensor, batch: _Batch, positions: Tensor) -> Tensor:
        plan = batch.plan
        greedy = penalized.argmax(dim=-1) if plan.any_greedy else None
        if plan.all_greedy:
            return greedy
        sampled = self._race(penalized, batch, positions)
        if greedy is None:
            return sampled
        return torch.where(batch.ip[_I_GREEDY].bool(), greedy, sampled)

    def _race(self, penalized: Tensor, batch: _Batch, positions: Tensor) -> Tensor:
        """Temperature, top_k, top_p, min_p, then the Gumbel-max race over what is left."""
        plan = batch.plan
        if plan.mode == "sort" and self._masks:
            return self._race_masked(penalized, batch, positions)
        if plan.mode == "sort" and self.device.type == "cpu" and self.vocab_size > _SORT_FIRST:
            return self._race_by_rows(penalized, batch, positions)
        if plan.mode == "none":
            return self._draw(penalized * batch.fp[_F_INV_TEMP].unsqueeze(1), None, batch, positions)
        cand, ids, _ = self._survivors(penalized, batch, plan.mode, plan.kmax)
        return self._draw(cand, ids, batch, positions)

    def _survivors(self, penalized: Tensor, batch: _Batch, mode: str, width: int,
                   full: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(candidates sorted descending at temperature, top_k / top_p masked to -inf; their ids;
        the whole-row mass used, `_full_mass`, computed here unless given)."""
        # Temperature does not change order, so pick candidates before scaling (fewer elements).
        cand, ids = self._candidates(penalized, batch, mode, width)
        cand = cand * batch.fp[_F_INV_TEMP].unsqueeze(1)
        if full is None:
            full = self._full_mass(penalized, cand, batch)
        return self._filter_sorted(cand, batch, full), ids, full

    def _race_masked(self, penalized: Tensor, batch: _Batch, positions: Tensor) -> Tensor:
        """"sort" mode on a GPU without deterministic inference: top_k and top_p as flashinfer's
        sort-free masks over the whole row (engine/layers/sampling_masks.py; sorting 64 rows x 128k
        cost 1.5 ms a step on an H100), then min_p and the race. The same nucleus as the sort's
        cumulative mass up to rounding and ties at its edge, which only deterministic inference,
        which keeps the sort, promises anything about."""
        plan = batch.plan
        z = penalized * batch.fp[_F_INV_TEMP].unsqueeze(1)
        if plan.use_top_k:
            z = sampling_masks.top_k_mask(z, batch.ip[_I_TOP_K])
        if plan.use_top_p:
            z = sampling_masks.top_p_mask(z, batch.fp[_F_TOP_P])
        return self._draw(z, None, batch, positions)

    def _race_by_rows(self, penalized: Tensor, batch: _Batch, positions: Tensor) -> Tensor:
        """"sort" mode on a CPU, where sorting the vocabulary is most of sampling (16 rows x 128k:
        ~80 ms on 2 cores). A row whose survivors lie among its first _SORT_FIRST candidates (a
        top_k up to that, or without top_k a top_p reached by then: nearly every real row) races over those; a
        row with nothing to filter over its whole row unsorted; only the rest are sorted. Each
        row's candidates, masses and draw are bit for bit those of the full sort's first entries
        (`_filter_sorted`), so which group a row falls in changes nothing but the time."""
        cand, ids, full = self._survivors(penalized, batch, "topk", _SORT_FIRST)
        k, top_p, greedy = batch.ip[_I_TOP_K], batch.fp[_F_TOP_P], batch.ip[_I_GREEDY].bool()
        whole = ~greedy & (k >= self.vocab_size) & (top_p >= 1.0)
        # every survivor is a candidate: a top_k within them, or top_p over the whole row dropped
        # the last one (or it is -inf, as all after it). A top_k between them and the vocabulary
        # measures top_p against its first k's sum, which these candidates do not hold: sorted.
        first = ~whole & (greedy | (k <= _SORT_FIRST) | ((k >= self.vocab_size) & (cand[:, -1] == -math.inf)))
        sort = ~(whole | first)
        tokens = torch.empty(len(k), dtype=torch.int64, device=penalized.device)
        for rows, how in ((first, "first"), (whole, "whole"), (sort, "sort")):
            r = rows.nonzero().squeeze(1)
            if not r.numel():
                continue
            sub = batch._replace(slots=batch.slots[r], fp=batch.fp[:, r], ip=batch.ip[:, r])
            if how == "first":
                tokens[r] = self._draw(cand[r], ids[r], sub, positions[r])
            elif how == "whole":
                tokens[r] = self._draw(penalized[r] * sub.fp[_F_INV_TEMP].unsqueeze(1), None, sub, positions[r])
            else:
                s_cand, s_ids, _ = self._survivors(penalized[r], sub, "sort", 0, None if full is None else full[r])
                tokens[r] = self._draw(s_cand, s_ids, sub, positions[r])
        return tokens

    def _draw(self, cand: Tensor, ids: Tensor | None, batch: _Batch, positions: Tensor) -> Tensor:
        """min_p, then the race over cand (temperature applied; ids: its token ids, None for a whole row)."""
        if batch.plan.use_min_p:
            cand = _min_p_mask(cand, batch.fp[_F_LOG_MIN_P], is_sorted=ids is not None)
        # Exponential race: argmax p_i / E_i == argmax logit_i - log E_i, E_i ~ Exp(1) i.i.d.
        seeds = batch.ip[_I_SEED]
        if self._fused_noise:
            cand = triton_ops.race_noise_(cand, seeds, positions, ids, _UNIFORM_BITS)
        elif self._c_noise:  # cand and ids are always fresh float32 / int64 rows here (race_noise_ checks)
            cand = cpu_kernels.race_noise_(cand, seeds, positions, ids, _UNIFORM_BITS)
        else:
            cand = cand.sub_(self._log_exp_noise(seeds, positions, ids))
        pick = cand.argmax(dim=-1)
        return pick if ids is None else ids.gather(1, pick.unsqueeze(1)).squeeze(1)

    def _candidates(self, penalized: Tensor, batch: _Batch, mode: str, width: int) -> tuple[Tensor, Tensor]:
        """Top_k / top_p candidates, sorted descending: the whole row ("sort") or its first `width`
        ("topk"). Under deterministic inference, equal logits come in id order, so which of them a
        row's top_k keeps and top_p's cumulative mass do not depend on the batch's largest top_k or
        on a neighbour's top_p (which makes it "sort")."""
        if mode == "sort":
            return penalized.sort(dim=-1, descending=True, stable=self.deterministic)
        if not self.deterministic:
            return penalized.topk(width, dim=-1)
        if self.device.type != "cpu":  # no host read on a GPU: rank every row
            return ranked_topk(penalized, width)
        # greedy rows take the argmax of the whole row, whatever their candidates
        row_k = batch.ip[_I_TOP_K].clamp(max=width).masked_fill(batch.ip[_I_GREEDY].bool(), 1)
        return canonical_topk(penalized, width, row_k)

    def _full_mass(self, penalized: Tensor, cand: Tensor, batch: _Batch) -> Tensor | None:
        """Per row, the sum of exp(logit / T - max) over the whole row in token order: top_p's total
        for a row without top_k (None where no row needs it). A cumsum's last entry, not a sum:
        torch sums a row in another order with the thread split, a cumsum always left to right."""
        if not batch.plan.whole_top_p:
            return None
        z = penalized * batch.fp[_F_INV_TEMP].unsqueeze(1)
        return z.sub_(cand[:, :1]).exp_().cumsum(dim=-1)[:, -1]

    def _filter_sorted(self, cand: Tensor, batch: _Batch, full: Tensor | None = None) -> Tensor:
        """Mask top_k / top_p on candidates sorted descending (rank 0 always survives). top_p's mass
        is exp(logit / T - max) summed left to right over the sorted candidates, against the row's
        total: its first k's sum (a cumsum entry) with top_k, `full` (`_full_mass`) without; so a
        row's survivors are the same bits from any number of candidates that holds them."""
        plan = batch.plan
        k = batch.ip[_I_TOP_K]
        if plan.use_top_k:
            ranks = torch.arange(cand.shape[1], device=cand.device)
            cand = cand.masked_fill(ranks >= k.unsqueeze(1), -math.inf)
        if plan.use_top_p:
            top_p = batch.fp[_F_TOP_P]
            e = (cand - cand[:, :1]).exp_()
            run = e.cumsum(dim=-1)
            total = run.gather(1, (k.clamp(max=cand.shape[1]) - 1).unsqueeze(1)).squeeze(1)
            if full is not None:
                total = torch.where(k >= self.vocab_size, full, total)
            # Rows with top_p == 1 are exempt: cumsum rounding could otherwise clip their tail.
            drop = (run.sub_(e) >= (top_p * total).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
            cand = cand.masked_fill(drop, -math.inf)
        return cand

    def _log_exp_noise(self, seeds: Tensor, positions: Tensor, ids: Tensor | None) -> Tensor:
        """log E for E ~ Exp(1), [B, C], from splitmix64(seed, position, token id); no RNG state.

        -log E is Gumbel(0, 1). This is the costly part of sampling ([B, V] int64 passes), so every
        step after the first allocation runs in place.
        """
        row = _mix64(seeds + (positions + 1) * _GAMMA).unsqueeze(1)
        counter = row + (self._id_gamma if ids is None else (ids + 1) * _GAMMA)
        # Low bits of the finalised splitmix64 output are as good as high ones and need no shift.
        bits = _mix64(counter).bitwise_and_((1 << _UNIFORM_BITS) - 1)
        u = bits.to(torch.float32).mul_(2.0**-_UNIFORM_BITS).add_(2.0 ** -(_UNIFORM_BITS + 1))
        return u.log_().neg_().log_()

    # ---- after the choice ----

    def _record(self, batch: _Batch, tokens: Tensor) -> None:
        """Add the chosen tokens to the penalty state (device scatter, no sync).

        Rows of requests without penalties are updated too (cheaper than masking); add() resets a
        row before a penalised request uses it.
        """
        plan = batch.plan
        if plan.any_bad:
            self._bad.record(batch.slots, tokens)
        if plan.any_repetition and self._seen is not None:
            self._seen.index_put_((batch.slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
        if plan.any_freq_presence and self._counts is not None:
            ones = torch.ones_like(tokens, dtype=torch.float32)
            self._counts.index_put_((batch.slots, tokens), ones, accumulate=True)

    def _with_logprobs(self, logits: Tensor, tokens: Tensor, plan: _Plan) -> SampleResult:
        if not plan.want_logprobs:
            return SampleResult(token_ids=tokens)
        logp = logits.log_softmax(dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if plan.num_top == 0:
            return SampleResult(token_ids=tokens, logprobs=chosen)
        top_lp, top_ids = ranked_topk(logp, plan.num_top)  # equal logprobs by id, whatever the batch's largest k
        return SampleResult(token_ids=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)

    # ---- helpers ----

    def _init_seen(self, slot: int, prompt_ids: Sequence[int] | Tensor) -> None:
        if self._seen is None:
            self._seen = torch.zeros(self.max_slots, self.vocab_size, dtype=torch.bool, device=self.device)
        row = self._seen[slot]
        row.zero_()
        ids = self._as_device(prompt_ids)
        if ids.numel():
            row.index_fill_(0, ids, True)

    def _init_counts(self, slot: int) -> None:
        if self._counts is None:
            self._counts = torch.zeros(self.max_slots, self.vocab_size, device=self.device)
        self._counts[slot].zero_()

    def _int_row(self, p: SampleParams, prompt_len: int) -> list[int]:
        top_k = self.vocab_size if p.top_k <= 0 else min(p.top_k, self.vocab_size)
        # the position of output token min_new_tokens: tokens sampled below it have their stops masked
        min_end = prompt_len + p.min_new_tokens if p.min_stop_ids else 0
        return [_mix64_int(p.seed), top_k, int(p.greedy), min_end]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")

    def _as_device(self, values: Sequence[int] | Tensor) -> Tensor:
        if isinstance(values, Tensor):
            return values.to(device=self.device, dtype=torch.int64)
        return self._upload(list(values), torch.int64)

    def _upload(self, values: list, dtype: torch.dtype) -> Tensor:
        """Host list -> device tensor without a stream sync (pinned + non_blocking on CUDA)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            # The caching host allocator keeps the pinned block alive until the copy is done.
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)


def _float_row(p: SampleParams) -> list[float]:
    inv_temp = 1.0 if p.greedy else 1.0 / p.temperature
    log_min_p = math.log(p.min_p) if p.min_p > 0 else -math.inf
    return [inv_temp, p.top_p, log_min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]


def _min_p_mask(cand: Tensor, log_min_p: Tensor, is_sorted: bool) -> Tensor:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p) (no softmax needed)."""
    top = cand[:, :1] if is_sorted else cand.amax(dim=-1, keepdim=True)
    return cand.masked_fill(cand < top + log_min_p.unsqueeze(1), -math.inf)
