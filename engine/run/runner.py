"""ModelRunner: one rank's deterministic replica of the Step stream.

It applies each Step's ops to its replica (engine/replica: page tables, slot sampling,
prefix-cache pages; the sampler's device state as an effect), runs the
forward, samples, and answers a StepDone. It makes no policy decision: everything it
does is a function of the steps it received, in seq order. What is built once before the
first step (the model, the KV pool, the bound backend, warm-up, CUDA graphs) is
engine/run/assembly.py; this file is step execution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import structlog
import torch

from engine.config import ServerConfig
from engine.env import env
from engine.layers import batch_invariant, triton_ops
from engine.layers.forward import ForwardBatch
from engine.layers.parallel import parallel_state
from engine.replica import Effect, ReplicaError, StepOrderError, TokenChain, rank_replica
from engine.run import prompt_scores
from engine.run.assembly import assemble, make_ready, make_speculator
from engine.run.expert_counts import ExpertCounts
from engine.run.grammar import GrammarSlots
from engine.run.host_tier import HostCopies
from engine.run.idle import IdleMeter, StepEvents
from engine.run.sample_params import SampleParams
from engine.run.sampler import Sampler, SampleResult
from engine.run.spec import VerifiedResult, VerifyRows
from engine.run.step_profile import StepProfiler
from msgs.codec import id_count, pack_f32, pack_ids, unpack_ids
from msgs.done import GrammarReady, SpecDone, StepDone, WorkerReady
from msgs.steps import AddReq, Forward, FreeReq, Step

log = structlog.get_logger()
__all__ = ["ModelRunner", "StepOrderError"]


class SamplerSlots(Effect):
    """The sampler's per-slot device state follows AddReq / FreeReq (not digested: the
    replica's SlotSampling component holds the same parameters on the host)."""

    ops = (AddReq, FreeReq)

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def apply(self, op: AddReq | FreeReq) -> None:
        if isinstance(op, AddReq):
            self.sampler.add(op.slot, _sample_params(op), unpack_ids(op.prompt_ids), unpack_ids(op.output_ids))
        else:
            self.sampler.remove(op.slot)


@dataclass
class Launched:
    """A step whose work is enqueued; `result` holds host tensors once `event` completes."""

    seq: int
    digest: str | None
    t0: float
    result: SampleResult | None
    event: torch.cuda.Event | None
    timing: StepEvents | None = None
    to_sample: _ToSample | None = None  # sampling deferred until `complete` (grammar rows)
    start: torch.cuda.Event | None = None  # the idle meter's start event
    rows: int = 0
    scores: prompt_scores.PromptScores | None = None  # Forward.prompt's rows (rank 0), host copies


@dataclass
class _ToSample:
    """A forward's logits and the rows to sample from them."""

    logits: torch.Tensor
    slots: list[int]  # the sampled rows' slots
    positions: list[int]
    slots_dev: torch.Tensor | None  # the same slots on the device, when already there
    verify: VerifyRows | None = None  # a verify step: slots/positions have one entry per logit row
    req_slots: list[int] | None = None  # ... and these are the sampled requests' slots


class ModelRunner:
    def __init__(self, cfg: ServerConfig, rank: int = 0, served: bool = False) -> None:
        """Assemble (engine/run/assembly.py: load, size, bind), set up the step state, then make
        ready (warm up, capture). served: a worker process (procs/worker.py), whose grammar compiler
        warms from Ready on; in-process engines build it on their first grammar."""
        self.cfg = cfg
        self.rank = rank
        a = assemble(cfg, rank)
        self.device, self.dtype, self.deterministic = a.device, a.dtype, a.deterministic
        self.model, self.mcfg, self.shard, self.kv_layout = a.model, a.mcfg, a.shard, a.kv_layout
        self.kv_dtype, self.kv, self.backend = a.kv_dtype, a.kv, a.backend
        self.page_size, self.num_pages, self.max_context = cfg.page_size, a.num_pages, a.max_context
        self.startup = a.startup  # time to ready, by phase (Ready's info)
        self.sampler = Sampler(self.mcfg.vocab_size, cfg.max_running_requests, self.device, self.deterministic)
        # grammar matchers per slot (engine/run/grammar.py): an effect, like the sampler's state
        on = cfg.constrained_decoding
        self.grammar = GrammarSlots(cfg.model, self.mcfg.vocab_size, cfg.max_running_requests, self.device,
                                    helpers=0 if not on else None if cfg.grammar_helpers < 0 else cfg.grammar_helpers,
                                    warm=served and on)  # a served worker's grammars: warm from Ready on
        self.replica = rank_replica([SamplerSlots(self.sampler), self.grammar])
        self.tokens = TokenChain()  # every token this rank sampled, for DigestCheck
        self.deferred: Launched | None = None  # the launched step whose sampling waits (grammar)
        self.scores: prompt_scores.PromptScores | None = None  # the last forward's prompt scores (rank 0)
        ps = parallel_state()  # under cp the slab region is the tp rank's, shared by its cp ranks
        self.host_tier = HostCopies(self.kv, cfg.hicache_path, ps.tp.rank, ps.tp.world, ps.cp.rank, ps.cp.world)
        self.replica.add_effect(self.host_tier)
        self.last_token = torch.zeros(cfg.max_running_requests, dtype=torch.int64, device=self.device)
        self.spec = make_speculator(cfg, a)
        self.seq = 0
        self.idle = IdleMeter() if self.device.type == "cuda" else None
        spec = env().profile_steps if self.device.type == "cuda" else None
        self.profiler = StepProfiler(spec, cfg.log_dir, rank) if spec else None
        self.graphs = None
        self.expert_counts: ExpertCounts | None = None
        make_ready(self)  # warm up and capture: nothing compiles after this

    def ready_msg(self) -> WorkerReady:
        return WorkerReady(
            rank=self.rank,
            num_pages=self.num_pages,
            page_size=self.page_size,
            max_context=self.max_context,
            vocab_size=self.mcfg.vocab_size,
            eos_token_ids=list(self.mcfg.eos_token_ids),
            page_bytes=self.host_tier.page_bytes,
            deterministic=self.deterministic,
            device_type=self.device.type,
        )

    def run_step(self, step: Step) -> StepDone:
        """Apply and run one step to completion (launch + finish)."""
        return self.finish(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: Step) -> Launched:
        """Apply the ops and enqueue the forward and sampling; on a GPU this returns before the
        kernels finish, so the next step can be launched while this one runs.

        A step with grammar-constrained rows leaves its sampling deferred (`deferred`): the
        mask needs the previous step's tokens, so the worker first answers that step, and
        only then `complete`s this one (the scheduler plans the next step meanwhile)."""
        if self.deferred is not None:  # a newer step never overtakes an unsampled one
            self.complete(self.deferred)
        t0 = time.perf_counter()
        # a gap means a lost Step: StepOrderError, never continue silently
        digest_due = self.replica.apply_step(step)
        self.seq = step.seq
        launched = Launched(step.seq, None, t0, None, None)
        if step.forward is not None:
            if batch_invariant.enabled() != self.deterministic:  # another engine in this process set it
                batch_invariant.enable(self.deterministic, self.device.type)
            if self.profiler is not None:
                self.profiler.tick()
            launched.start = self.idle.start() if self.idle is not None else None
            launched.rows = id_count(step.forward.slots)
            launched.to_sample = self._forward(step.forward)
            if self.scores is not None:
                launched.scores, self.scores = _scores_to_host(self.scores), None
        # the replica's state after this step's ops, hashed while the device runs the forward
        # (nothing changes it before the next step's ops: a millisecond or more with a full tree)
        launched.digest = self.replica.digest() if digest_due else None
        if launched.to_sample is not None and self.grammar.constrained(launched.to_sample.slots):
            self.deferred = launched
        else:
            self.complete(launched)
        # this step's backups (their KV is written by the forward), after its sampling: on a GPU
        # an event behind both and a hand-over to the host tier's copier thread
        self.host_tier.after_forward()
        return launched

    @property
    def compiling(self) -> bool:
        """Grammars this rank compiles in the background (PrepareGrammar), not reported yet."""
        return self.grammar.compiling

    def grammar_reports(self, wait: bool = False) -> list[GrammarReady]:
        """The grammars this rank finished compiling since the last call (wait: block until
        one did, unless none compiles): the scheduler admits their requests once every rank did."""
        return [GrammarReady(self.rank, key, generation, error)
                for key, generation, error in self.grammar.compiled(wait)]

    def host_busy(self) -> bool:
        """A host thread of this runner is working (the grammar job): the worker's loop
        should wait without the GIL rather than spin."""
        return self.grammar.busy

    @torch.inference_mode()
    def complete(self, launched: Launched) -> None:
        """Enqueue a launched step's sampling (masks first) and its result copies."""
        if launched is self.deferred:
            self.deferred = None
        to_sample, launched.to_sample = launched.to_sample, None
        res = self._sample(to_sample) if to_sample is not None else None
        launched.result = _to_host(res) if res is not None else None
        launched.event = self._event()
        if launched.start is not None and launched.event is not None:
            launched.timing = StepEvents(launched.start, launched.event, launched.rows)

    def ready(self, launched: Launched) -> bool:
        if launched is self.deferred:
            return False
        return launched.event is None or launched.event.query()

    def finish(self, launched: Launched) -> StepDone:
        """Wait for a launched step's results (the one host sync of a step) and pack them."""
        if launched is self.deferred:
            self.complete(launched)
        if launched.event is not None:
            launched.event.synchronize()
        if launched.timing is not None and self.idle is not None:
            self.idle.finished(launched.timing)
        done = _pack_result(launched.seq, self.rank, launched.result) if launched.result else None
        self.tokens.update(done.token_ids if done else b"")
        expert_tokens = None
        if self.rank == 0 and self.expert_counts:  # cumulative, at a stats cadence (expert_counts.py)
            drained = launched.rows == 0 and launched.seq == self.seq
            expert_tokens = self.expert_counts.poll(time.monotonic(), drained)
        extra = {"accepted": done.accepted} if isinstance(done, SpecDone) else {}
        return (SpecDone if extra else StepDone)(
            **extra,
            seq=launched.seq,
            rank=self.rank,
            token_ids=done.token_ids if done else b"",
            logprobs=done.logprobs if done else None,
            top_ids=done.top_ids if done else None,
            top_logprobs=done.top_logprobs if done else None,
            top_k=done.top_k if done else 0,
            digest=launched.digest,
            tokens_hash=self.tokens.hexdigest() if launched.digest is not None else None,
            forward_s=time.perf_counter() - launched.t0,
            expert_tokens=expert_tokens,
            **_pack_scores(launched.scores),
        )

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=self.idle is not None)
        event.record()
        return event

    def _forward(self, fwd: Forward) -> _ToSample | None:
        """Enqueue the forward; the logits of the rows to sample (None: no row samples)."""
        slots = unpack_ids(fwd.slots)
        starts = unpack_ids(fwd.start_pos)
        lens = unpack_ids(fwd.extend_lens)
        sample = unpack_ids(fwd.sample)
        ids = unpack_ids(fwd.input_ids)
        tables = [self.replica["page_tables"].tables[s] for s in slots]
        if fwd.drafts is not None and self.spec is not None:
            return self._forward_verify(fwd, ids, slots, starts, lens, sample, tables)
        if fwd.drafts is not None:
            raise ReplicaError("a Step verifies drafts, but speculative decoding is off on this rank")
        slots_dev = None  # the sampled rows' slots on the device, when already there
        graphed = fwd.prompt is None and all(n == 1 for n in lens)
        if self.graphs is not None and len(slots) <= self.graphs.max_batch and graphed:
            # decode: the captured graph, fed straight from the Step's lists
            logits = self.graphs.run_decode(ids, slots, starts, tables, self.last_token)
            if self.spec is not None:  # a draft model or head follows the replayed rows
                self.spec.follow_replay(self.graphs, starts, lens, tables, sample)
            if all(sample):
                slots_dev = self.graphs.slots[: len(slots)]
            else:
                rows = [i for i, smp in enumerate(sample) if smp]
                logits = logits[_to_device(torch.tensor(rows, dtype=torch.int64), self.device)] if rows else None
        else:
            input_ids = self.resolve_ids(ids, slots, lens)
            rows = every = None
            if fwd.prompt is not None:  # rows scoring their prompt: every token's logits (prompt_scores.py)
                scored = unpack_ids(fwd.prompt.rows)
                rows = prompt_scores.split(ids, lens, sample, scored, unpack_ids(fwd.prompt.next_ids))
                every = [False] * len(lens)
                for i in scored:
                    every[i] = True
            batch = ForwardBatch.build(input_ids, starts, lens, tables, sample, self.page_size, self.device, every)
            self.backend.prepare(batch)
            logits = self.model(batch, self.kv, self.backend)
            if rows is not None and fwd.prompt is not None:
                if self.rank == 0:  # (only rank 0 answers; logits are the same on every rank)
                    self.scores = prompt_scores.score(logits, rows, fwd.prompt.top_k)
                logits = logits.index_select(0, _to_device(torch.tensor(rows.sampled, dtype=torch.int64), self.device))
            if self.spec is not None:  # a separate draft model writes its KV for the same tokens
                self.spec.follow(batch)
        sampled_slots = [s for s, smp in zip(slots, sample, strict=True) if smp]
        if not sampled_slots:
            return None
        positions = [st + n for st, n, smp in zip(starts, lens, sample, strict=True) if smp]
        return _ToSample(logits, sampled_slots, positions, slots_dev)

    def _forward_verify(self, fwd: Forward, ids: list[int], slots: list[int], starts: list[int], lens: list[int],
                        sample: list[int], tables: list[list[int]]) -> _ToSample | None:
        """A verify step (engine/run/spec.py: Speculator.forward)."""
        assert self.spec is not None
        out = self.spec.forward(self, fwd, ids, slots, starts, lens, sample, tables)
        if out is None:
            return None
        logits, row_slots, positions, v, req_slots = out
        return _ToSample(logits, row_slots, positions, None, verify=v, req_slots=req_slots)

    def _sample(self, t: _ToSample) -> SampleResult:
        if t.verify is not None:
            return self._sample_verify(t)
        self.grammar.mask(t.logits, t.slots)  # constrained rows only; waits for last step's tokens
        res = self.sampler.sample(t.logits, t.slots, t.positions)
        self.grammar.sampled(t.slots, res.token_ids)
        slots_dev = t.slots_dev
        if slots_dev is None:
            slots_dev = _to_device(torch.tensor(t.slots, dtype=torch.int64), self.device)
        self.last_token.index_copy_(0, slots_dev, res.token_ids)
        return res

    def _sample_verify(self, t: _ToSample) -> SampleResult:
        """A verify step's tokens (engine/run/spec.py: Speculator.sample)."""
        assert self.spec is not None and t.verify is not None and t.req_slots is not None
        return self.spec.sample(self, t.logits, t.slots, t.positions, t.verify, t.req_slots)

    def resolve_ids(self, ids: list[int], slots: list[int], lens: list[int]) -> torch.Tensor:
        """Replace future references (-1) with the token the slot sampled last step."""
        t = _to_device(torch.tensor(ids, dtype=torch.int64), self.device)
        if -1 not in ids:
            return t
        token_slots = _to_device(
            torch.tensor([s for s, n in zip(slots, lens, strict=True) for _ in range(n)], dtype=torch.int64),
            self.device,
        )
        return torch.where(t < 0, self.last_token[token_slots], t)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync (a blocking H2D copy waits for the device)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _sample_params(op: AddReq) -> SampleParams:
    """The wire's sampling fields are SampleParams' fields; top_k -1 (off) is 0 here."""
    fields = msgspec.structs.asdict(op.sampling)
    bias = tuple(sorted(op.sampling.logit_bias.items()))
    return SampleParams(**{**fields, "top_k": max(op.sampling.top_k, 0), "logit_bias": bias,
                           "min_stop_ids": tuple(op.sampling.min_stop_ids),
                           "allowed_token_ids": tuple(op.sampling.allowed_token_ids),
                           "bad_words_ids": tuple(tuple(w) for w in op.sampling.bad_words_ids)})


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start a device-to-host transfer without waiting for it (on CUDA stored by a kernel into
    pinned memory: never behind the host tier's copies)."""
    if t is None:
        return None
    return triton_ops.to_host(t) if t.is_cuda else t


def _to_host(res: SampleResult) -> SampleResult:
    """A step's results on their way to the host (_host)."""
    if isinstance(res, VerifiedResult):
        return VerifiedResult(_host(res.token_ids), _host(res.logprobs), _host(res.top_ids), _host(res.top_logprobs),
                              accepted=_host(res.accepted), keep=_host(res.keep))
    return SampleResult(_host(res.token_ids), _host(res.logprobs), _host(res.top_ids), _host(res.top_logprobs))


def _scores_to_host(s: prompt_scores.PromptScores) -> prompt_scores.PromptScores:
    return prompt_scores.PromptScores(_host(s.logprobs), _host(s.top_ids), _host(s.top_logprobs))  # type: ignore[arg-type]


def _pack_scores(s: prompt_scores.PromptScores | None) -> dict:
    """StepDone's prompt_* fields (after the step's event: the host copies are done)."""
    if s is None:
        return {}
    out: dict = {"prompt_logprobs": pack_f32(s.logprobs.tolist())}
    if s.top_ids is not None and s.top_logprobs is not None:
        out.update(prompt_top_ids=pack_ids(s.top_ids.flatten().tolist()),
                   prompt_top_logprobs=pack_f32(s.top_logprobs.flatten().tolist()), prompt_top_k=s.top_ids.shape[1])
    return out


def _pack_result(seq: int, rank: int, res: SampleResult) -> StepDone:
    if isinstance(res, VerifiedResult):  # the answered rows, selected here on the host
        res = res.answered()
    tokens = res.token_ids.tolist()
    logprobs = pack_f32(res.logprobs.tolist()) if res.logprobs is not None else None
    top_ids = top_lps = None
    k = 0
    if res.top_ids is not None:
        k = res.top_ids.shape[1]
        top_ids = pack_ids(res.top_ids.flatten().tolist())
        top_lps = pack_f32(res.top_logprobs.flatten().tolist())
    fields = dict(seq=seq, rank=rank, token_ids=pack_ids(tokens), logprobs=logprobs, top_ids=top_ids,
                  top_logprobs=top_lps, top_k=k)
    if isinstance(res, VerifiedResult) and res.accepted is not None:
        return SpecDone(**fields, accepted=pack_ids(res.accepted.tolist()))
    return StepDone(**fields)
