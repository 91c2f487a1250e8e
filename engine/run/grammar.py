"""Grammar matchers on a rank: replicated per-slot state, and the logits mask they make.

`GrammarSlots` is an Effect of the rank's replica: PrepareGrammar starts compiling a grammar
on a background thread (or in every grammar helper), and `compiled` reports it done (the worker
sends GrammarReady: the scheduler admits its requests only then, engine/sched/grammars.py);
AddReq with a grammar creates the slot's xgrammar GrammarMatcher from the compiled grammar
(re-advanced over `output_ids` after a retraction), FreeReq drops it. Every rank advances its
own matchers with the tokens it sampled, so no round trip to the scheduler is needed; the
matcher's state is a function of the Step stream and the sampled tokens, which the digest's
token chain already covers. Where the matchers live: in this process (CPU), or in grammar
helper processes (GPU; engine/run/grammar_helper.py), which accept and fill a step's rows in
parallel; the interface below is the same.

Overlap: step N+1's forward is launched before the matchers have seen step N's tokens;
only its sampling waits for the mask. When step N samples, `sampled` starts a job on one
host thread: wait for N's token copy (its event), accept the tokens (Python ints: xgrammar's
binding rejects tensor scalars; its batch matcher's thread pool), fill those slots' next
bitmask rows. It runs while the worker's thread answers step N-1 and waits for step N+1 on
its socket (xgrammar holds the GIL, a socket wait does not; with helpers the job only waits
on their pipes). The runner launches a constrained step without its sampling and samples it
after answering the previous step (runner.py, `deferred`). `mask` for step N+1 joins it,
fills only rows it could not know (requests added by this step) and masks the constrained
rows only. On CUDA one triton kernel (engine/layers/triton_ops.py `mask_by_slot`) reads each
row's bitmask by slot straight from host memory (pinned, or the helpers' shared memory
registered with cudaHostRegister) and the (logits row, slot) pairs from a pinned buffer: no
gather, no copy, one launch. Host buffers are rewritten only after the previous constrained
step's tokens reached the host, which come after its mask kernel in stream order. On CPU
the rows are gathered by logits row and masked by xgrammar's C++ kernel. The bitmask spans the model's
vocabulary (the TokenizerInfo has the model's vocab size), so ids past the tokenizer's
vocabulary are masked too. Requests without a grammar never wait.

Speculative verify rows: each drafted position gets its own mask (engine/run/grammar_drafts.py:
in process inside `mask`; with helpers filled by a job that `drafting` queues before the verify
forward, joined by `mask`; on CUDA a second `mask_by_slot` launch over the drafted rows).

Timing: every TIMING_WINDOW constrained steps one `grammar timing` log line gives the mean
milliseconds per step of each part: the job's wait for the tokens, its accept and fill, the
worker thread's wait in `mask` for the job, the rest of `mask` (late fills and the mask
itself), and the period between two masks (what a constrained step costs the host). With
grammar helpers, `accept` is the helpers' accept and fill together (IPC included) and `fill` 0;
`drafts` is the helpers' filling of verify rows' drafted positions (the job before the mask).

A finished grammar (its stop token accepted) is terminated: the scheduler ends the request
on that token, and a row of it still sampled by the overlap step is left unmasked (its
token is discarded).
"""

from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from engine.layers import triton_ops
from engine.replica import Effect, ReplicaError
from engine.replica.components import GrammarKeys
from engine.run.grammar_drafts import DraftMasks
from engine.run.grammar_helper import MAX_DRAFTS, GrammarHelpers, allocate_bitmask, utf8_guard, xgr
from engine.run.pinning import register_host
from engine.tokenizer import compile_grammar, grammar_compiler, load_tokenizer, tokenizer_info
from msgs.codec import unpack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, Flush, FreeReq, PrepareGrammar

log = structlog.get_logger()
TIMING_WINDOW = 100  # constrained steps per `grammar timing` line
COMPILE_THREADS = 2  # xgrammar's threads for one compile in the worker (a CPU worker's cores are the forward's)
TIMING_KEYS = ("tokens_wait", "accept", "fill", "drafts", "join_wait", "mask", "period")


class _Timing:
    """Sums of seconds by part over the constrained steps since the last line (any thread adds)."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(TIMING_KEYS, 0.0)
        self.steps = 0
        self.rows = 0
        self.last_mask: float | None = None

    def step(self, rows: int, now: float) -> None:
        if self.last_mask is not None and now - self.last_mask < 0.05:  # not across idle gaps
            self.sums["period"] += now - self.last_mask
        self.last_mask = now
        self.steps += 1
        self.rows += rows
        if self.steps == TIMING_WINDOW:
            ms = {f"{k}_ms": round(v / self.steps * 1e3, 3) for k, v in self.sums.items()}
            log.info("grammar timing", steps=self.steps, rows_per_step=round(self.rows / self.steps, 1), **ms)
            self.sums = dict.fromkeys(TIMING_KEYS, 0.0)
            self.steps = self.rows = 0


@dataclass
class _Pending:
    """Tokens a step sampled for constrained rows, on their way to the host."""

    tokens: torch.Tensor  # host copy (non-blocking on CUDA) of the step's sampled tokens
    event: torch.cuda.Event | None  # completes when `tokens` is filled
    rows: list[tuple[int, int, Any]]  # (row in the step's sampled tokens, slot, the matcher it goes to)


class _Remote:
    """A matcher that lives in a grammar helper process (engine/run/grammar_helper.py)."""

    __slots__ = ("id", "terminated")

    def __init__(self, id: int, terminated: bool) -> None:
        self.id = id
        self.terminated = terminated

    def is_terminated(self) -> bool:
        return self.terminated


def default_helpers(device: torch.device) -> int:
    """Grammar helper processes of a rank: on a GPU half the cores, at most 8 (64 rows'
    accepts take ~3 ms of one core, longer than a small model's step; 8 beat 4 on the H200);
    none on CPU, where the forward is the work and the cores are its."""
    return min(8, (os.cpu_count() or 1) // 2) if device.type == "cuda" else 0


class GrammarSlots(Effect, DraftMasks):
    ops = (PrepareGrammar, AddReq, FreeReq, Flush)

    def __init__(
        self, model_dir: str, vocab_size: int, max_slots: int, device: torch.device, background: bool = True,
        helpers: int | None = None, warm: bool = False,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.device = device
        self.matchers: dict[int, Any] = {}  # slot -> xgr.GrammarMatcher
        self._info: Any = None  # xgr.TokenizerInfo, built on the first grammar
        self._guard: torch.Tensor | None = None  # its utf8_guard row
        # the grammars this rank holds, by the replica's rule (GrammarKeys: PrepareGrammar brings
        # a key in with its data); in process: compiled on a thread, by key
        self._keys = GrammarKeys()
        self._compiled: dict[str, Any] = {}
        # key -> (its PrepareGrammar's generation, the compile job; None: the helpers compile it)
        self._compiling: dict[str, tuple[int, Future[Any] | None]] = {}
        self._compiler: Any = None  # xgr.GrammarCompiler, made with the TokenizerInfo (compile thread)
        self._compiler_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # warm: the in-process compiler made on the compile thread from wait_ready on, in the background
        # (importing xgrammar and building the tokenizer info took 1.3 s of the first constrained request
        # on 2 cores; beside the model's warm-up it slowed that by as much); a grammar queues behind it
        self._warm_compiler = warm
        self._warming: Future[None] | None = None
        self._pending: _Pending | None = None  # without a background thread: advanced by the next mask
        self._job: Future[None] | None = None  # with one: the job advancing the last constrained step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar") if background else None
        self._ready: dict[int, Any] = {}  # slot -> the matcher whose next-token row is in _bitmask
        self._init_drafts(max_slots)
        n = default_helpers(device) if helpers is None else helpers
        self._helpers = GrammarHelpers(n, model_dir, vocab_size, max_slots) if n > 0 else None
        self._next_id = 0  # a helper's matchers are named by id: a slot is reused
        # by slot; with helpers, the shared memory they fill
        self._bitmask = self._helpers.bitmask if self._helpers else allocate_bitmask(max_slots, vocab_size)
        self._adding: dict[int, tuple[int, str, _Remote]] = {}  # helper matchers not settled: id -> slot, rid
        self._finalizer: weakref.finalize | None = None  # unregisters the helpers' bitmask (CUDA)
        if device.type == "cuda":  # the mask kernel reads the bitmask and the row pairs in host memory
            if self._helpers is not None:  # the helpers' memfd, unregistered before it is unmapped
                self._finalizer = register_host(self, self._bitmask, self._helpers, "the grammar bitmask")
            else:
                self._bitmask = self._bitmask.pin_memory()
            # (logits row, bitmask row) pairs: the slots' rows, then (helpers) drafted positions'
            pair_rows = max_slots * (1 + (MAX_DRAFTS if self._helpers is not None else 0))
            self._pairs = torch.zeros(2 * pair_rows, dtype=torch.int32).pin_memory()
            self._pairs_np = self._pairs.numpy()
            self._bitmask_ptr = triton_ops.HostPointer(self._bitmask)
            self._pairs_ptr = triton_ops.HostPointer(self._pairs)
        else:
            self._staging = allocate_bitmask(max_slots, vocab_size)  # by logits row, for the CPU kernel
        self._batch_matcher: Any = None  # xgr.BatchGrammarMatcher, made on first use (_batch)
        self.rejected = 0  # sampled tokens a matcher refused (never expected: the mask forbids them)
        self.timing = _Timing()
        if device.type == "cuda":
            self._warm()

    def _warm(self) -> None:
        """Compile the triton mask kernel now, not in a served step (its row count is the grid,
        nothing is specialized on it: one compile)."""
        logits = torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device)
        self._pairs_np[:2] = (0, 0)
        triton_ops.mask_by_slot(logits, self._bitmask_ptr, self._bitmask.shape[1], self._pairs_ptr, 1, self.vocab_size)
        torch.cuda.synchronize(self.device)

    @property
    def _batch(self) -> Any:
        """Fills and accepts the rows of a step on xgrammar's thread pool (64 rows: ~1 ms serially)."""
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher("auto")
        return self._batch_matcher

    # ---- replica ops ----

    def apply(self, op: PrepareGrammar | AddReq | FreeReq | Flush) -> None:
        if isinstance(op, Flush):  # GrammarKeys empties: drop every grammar (live matchers keep theirs)
            if self._helpers is not None:
                for key in self._keys.keys:
                    self._helpers.forget(key)
            self._keys.apply(op)
            for key in list(self._compiling):
                self._drop_compile(key)
            self._compiled.clear()
            return
        if isinstance(op, PrepareGrammar):
            self._prepare(op.grammar)
            return
        if isinstance(op, FreeReq):
            gone = self.matchers.pop(op.slot, None)
            self._ready.pop(op.slot, None)
            if self._helpers is not None and gone is not None:
                self._adding.pop(gone.id, None)
                self._helpers.free(gone.id, op.slot)
            return
        if op.slot in self.matchers:
            raise ReplicaError(f"AddReq for busy grammar slot {op.slot}")
        if op.grammar is None:
            return
        self._keys.apply(op)  # a key not held: ReplicaError
        if self._helpers is not None:  # the helper re-advances it and fills its row; settled in mask
            self._next_id += 1
            ids = [int(t) for t in unpack_ids(op.output_ids)]
            self._helpers.add(self._next_id, op.slot, op.grammar.key, ids)
            remote = _Remote(self._next_id, False)
            self._adding[remote.id] = (op.slot, op.rid, remote)
            self.matchers[op.slot] = self._ready[op.slot] = remote
            return
        matcher = xgr.GrammarMatcher(self._compiled_grammar(op.grammar.key))
        for tok in unpack_ids(op.output_ids):  # a retracted request's tokens so far
            if not matcher.accept_token(int(tok)):
                raise ReplicaError(f"slot {op.slot} ({op.rid}): its grammar refuses its own output token {tok}")
        self.matchers[op.slot] = matcher

    def _prepare(self, grammar: Grammar) -> None:
        """Follow GrammarKeys: the key comes in (keys it evicts are dropped; matchers using them
        keep their grammar) and compiles in the background, in this process or in every helper
        at once; `compiled` reports it."""
        for key in self._keys.prepare(grammar):  # no data: ReplicaError
            self._drop_compile(key)
            self._compiled.pop(key, None)
            if self._helpers is not None:
                self._helpers.forget(key)
        generation = self._keys.prepared
        self._drop_compile(grammar.key)  # prepared again (it failed on some rank)
        self._compiled.pop(grammar.key, None)
        if self._helpers is not None:
            self._helpers.prepare(grammar.key, grammar.data, generation)
            self._compiling[grammar.key] = (generation, None)
        else:
            self._compiling[grammar.key] = (generation, self._compiler_pool.submit(self._compile, grammar.data))

    def _drop_compile(self, key: str) -> None:
        """Forget a compile; one not started yet is cancelled (it would hold up the next ones)."""
        _, job = self._compiling.pop(key, (0, None))
        if job is not None:
            job.cancel()

    def _warm(self) -> None:
        """The compiler, on the compile thread; a model without tokenizer files (or a missing xgrammar)
        fails the first grammar, as before."""
        try:
            self._compiler = grammar_compiler(self._tokenizer_info(), COMPILE_THREADS)
        except Exception as exc:  # noqa: BLE001 - reported when a grammar needs it
            log.info("grammar compiler not warmed", reason=str(exc)[:200])

    def _compile(self, data: bytes) -> Any:
        """On the compile thread (xgrammar releases the GIL while it compiles)."""
        if self._compiler is None:
            self._compiler = grammar_compiler(self._tokenizer_info(), COMPILE_THREADS)
        return compile_grammar(self._compiler, data)

    @property
    def compiling(self) -> bool:
        """Grammars prepared and not reported yet (`compiled`)."""
        return bool(self._compiling)

    def compiled(self, wait: bool = False) -> list[tuple[str, int, str]]:
        """(key, generation, error: "" when it compiled) of the grammars this rank finished
        compiling since the last call (on every helper). wait: block until one is, unless
        nothing compiles (the in-process engine's idle loop; tests)."""
        while True:
            done: list[tuple[str, int, str]] = []
            if self._helpers is not None:
                for key, generation, error in self._helpers.prepared():
                    if self._compiling.get(key, (None,))[0] == generation:
                        del self._compiling[key]
                        done.append((key, generation, error))
            else:
                for key, (generation, job) in list(self._compiling.items()):
                    if job is None or not job.done():
                        continue
                    del self._compiling[key]
                    error = "" if job.exception() is None else f"{type(job.exception()).__name__}: {job.exception()}"
                    if not error:
                        self._compiled[key] = job.result()
                    done.append((key, generation, error))
            if done or not wait or not self._compiling:
                return done
            time.sleep(0.001)

    def _compiled_grammar(self, key: str) -> Any:
        compiled = self._compiled.get(key)
        if compiled is None:  # the scheduler admits only after this rank reported it compiled
            raise ReplicaError(f"AddReq names grammar {key[:12]}, which this rank has not compiled")
        return compiled

    def _tokenizer_info(self) -> Any:
        if self._info is None:  # once, on the first constrained request: the tokenizer process's twin
            tok = load_tokenizer(self.model_dir)
            if tok is None:
                raise ReplicaError(f"a grammar arrived, but {self.model_dir!r} has no tokenizer files")
            self._info = tokenizer_info(tok.hf, self.vocab_size)
            self._guard = utf8_guard(self._info)
        return self._info

    # ---- per step ----

    def constrained(self, slots: list[int]) -> bool:
        """Some of these sampled slots have a grammar (their mask may wait for a job)."""
        return bool(self.matchers) and any(s in self.matchers for s in slots)

    @property
    def verifies_drafts(self) -> bool:
        """Speculative decoding: a constrained row's drafted positions get their own masks (grammar
        helpers, or in-process matchers on CPU); else (in process on CUDA: `--grammar-helpers 0`)
        its drafts are all rejected (engine/run/spec.py)."""
        return self._helpers is not None or self.device.type == "cpu"

    def mask(self, logits: torch.Tensor, slots: list[int], drafts: dict[int, list[int]] | None = None) -> None:
        """Mask the rows of constrained slots in place (logits: one row per sampled slot; a
        speculative verify row has one per logit position, its slot repeated, its drafts in
        `drafts` by slot: its first row gets the slot's mask, the next ones `_mask_drafted`)."""
        if not self.matchers:
            return
        rows = [(i, s, self.matchers[s]) for i, s in enumerate(slots)
                if s in self.matchers and (i == 0 or slots[i - 1] != s)]  # a slot's first row
        if not rows:
            return
        t0 = time.perf_counter()
        self._join()  # the previous constrained step's tokens are accepted and its rows filled
        self._settle()
        t1 = time.perf_counter()
        live = [(i, s, m) for i, s, m in rows if not m.is_terminated()]
        if not live:
            return
        stale = [(s, m) for _, s, m in live if self._ready.get(s) is not m]
        if stale and self._helpers is not None:  # rows the background job did not fill
            self._helpers.fill([(m.id, s) for s, m in stale])
        elif stale:  # new matchers (AddReq), or rows the background job did not fill
            self._fill([m for _, m in stale], [s for s, _ in stale])
        filled = self._drafted(live, drafts) if drafts and self._helpers is not None else {}
        if self.device.type == "cuda":
            pairs = self._pairs_np
            for j, (i, s, _) in enumerate(live):
                pairs[2 * j], pairs[2 * j + 1] = i, s
            triton_ops.mask_by_slot(logits, self._bitmask_ptr, self._bitmask.shape[1], self._pairs_ptr, len(live),
                                    self.vocab_size)
            if filled:
                self._mask_drafted_cuda(logits, live, filled)
        else:  # the bitmask is by slot; xgrammar's kernel wants it by logits row
            if len(slots) > self._staging.shape[0]:  # verify rows: more logits rows than slots
                self._staging = allocate_bitmask(len(slots), self.vocab_size)
            staging = self._staging[: len(slots)]
            torch.index_select(self._bitmask, 0, torch.tensor(slots, dtype=torch.int64), out=staging)
            indices = [i for i, _, _ in live]
            if filled:  # the helpers' drafted positions
                assert self._helpers is not None
                dst, src = self._drafted_pairs(live, filled)
                staging[dst] = self._helpers.drafted[src]
                indices += dst
            xgr.apply_token_bitmask_inplace(logits, staging, vocab_size=self.vocab_size, indices=indices,
                                            backend="cpu")
        if drafts and self._helpers is None and self.verifies_drafts:
            self._mask_drafted(logits, live, drafts)
        t2 = time.perf_counter()
        self.timing.sums["join_wait"] += t1 - t0
        self.timing.sums["mask"] += t2 - t1
        self.timing.step(len(live), t0)

    def _settle(self) -> None:
        """Take the helpers' replies to this step's new matchers (their rows are filled then);
        a grammar that refuses its request's own output so far (after a retraction) is fatal."""
        if not self._adding:
            return
        assert self._helpers is not None
        for id, (ok, terminated) in self._helpers.settle().items():
            entry = self._adding.pop(id, None)
            if entry is None:  # freed meanwhile
                continue
            slot, rid, remote = entry
            if not ok:
                raise ReplicaError(f"slot {slot} ({rid}): its grammar refuses its own output tokens")
            remote.terminated = terminated

    def sampled(self, slots: list[int], tokens: torch.Tensor) -> None:
        """This step's constrained rows sampled `tokens`: start the job that waits for them,
        has the matchers accept them and fills those slots' next bitmask rows, on a host
        thread, while this thread answers the previous step and receives the next one (both
        wait on sockets, without the GIL). The next `mask` joins it."""
        rows = [(i, s, self.matchers[s]) for i, s in enumerate(slots) if s in self.matchers]
        if not rows:
            return
        if self.device.type == "cuda":
            host = triton_ops.to_host(tokens)  # stored by a kernel: never behind the host tier's copies
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = tokens, None
        for _, s, _ in rows:
            self._ready.pop(s, None)  # their state changes with this token
        # at most one job is in flight: every constrained step calls mask (which joins) first
        pending = _Pending(host, event, rows)
        if self._pool is None:
            self._pending = pending
        else:
            self._job = self._pool.submit(self._advance, pending)

    def wait_ready(self) -> None:
        """Return once the helper processes (if any) are ready: before the worker's Ready. Without
        helpers (warm), start building the in-process compiler in the background."""
        if self._helpers is not None:
            self._helpers.wait_ready()
        elif self._warm_compiler and self._warming is None:
            self._warming = self._compiler_pool.submit(self._warm)

    def close(self) -> None:
        """Stop the helper processes (they also exit when this process goes)."""
        self._compiler_pool.shutdown(wait=False, cancel_futures=True)
        if self._helpers is not None:
            self._helpers.close()
        if self._drafted_reg is not None:
            self._drafted_reg()
        if self._finalizer is not None:
            self._finalizer()

    @property
    def busy(self) -> bool:
        """The job advancing the last constrained step is still running."""
        return any(job is not None and not job.done() for job in (self._job, self._draft_job))

    def _join(self) -> None:
        """The previous constrained step's accepts and fills, then this verify step's drafted
        positions (`drafting`); their errors are raised here, on the worker's thread."""
        job, self._job = self._job, None
        if job is not None:
            job.result()  # re-raises the job's error here, on the worker's thread
        pending, self._pending = self._pending, None
        if pending is not None:
            self._advance(pending)
        self._join_drafts()

    def _fill(self, matchers: list[Any], slots: list[int]) -> None:
        """The slots' next-token rows, with the tokens that would make ill-formed UTF-8 cleared
        (`utf8_guard`; the helpers do the same)."""
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, slots)
        self._bitmask[slots] &= self._guard

    def _advance(self, pending: _Pending) -> None:
        t0 = time.perf_counter()
        if pending.event is not None:
            pending.event.synchronize()
        t1 = time.perf_counter()
        sums = self.timing.sums
        sums["tokens_wait"] += t1 - t0
        toks = pending.tokens.tolist()  # Python ints
        # a matcher dropped by FreeReq meanwhile still gets its token: harmless, it is garbage
        live = [(toks[i], s, m) for i, s, m in pending.rows if not m.is_terminated()]
        if not live:
            return
        if self._helpers is not None:  # accepted and filled by the helpers, at once, without the GIL
            results = self._helpers.accept([(m.id, s, tok) for tok, s, m in live])
            sums["accept"] += time.perf_counter() - t1
            for (_, accepted, terminated), (tok, s, m) in zip(results, live, strict=True):
                m.terminated = terminated
                if not accepted:
                    self.rejected += 1
                    log.warning("grammar refused a sampled token", token=tok, rejected=self.rejected)
                if not terminated:
                    self._ready[s] = m
            return
        if len({id(m) for _, _, m in live}) < len(live):  # a verify step's answered tokens, in order
            ok = [m.accept_token(t) if not m.is_terminated() else True for t, _, m in live]
        else:
            ok = self._batch.batch_accept_token([m for _, _, m in live], [t for t, _, _ in live])
        t2 = time.perf_counter()
        sums["accept"] += t2 - t1
        for accepted, (tok, _, _) in zip(ok, live, strict=True):
            if not accepted:
                self.rejected += 1
                log.warning("grammar refused a sampled token", token=tok, rejected=self.rejected)
        fill = list({s: m for _, s, m in live if not m.is_terminated()}.items())  # one row per slot
        if fill:
            self._fill([m for _, m in fill], [s for s, _ in fill])
            for s, m in fill:
                self._ready[s] = m
        sums["fill"] += time.perf_counter() - t2
