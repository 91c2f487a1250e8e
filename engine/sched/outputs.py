"""Output processing and stop conditions: rank 0's sampled tokens -> ReqOutputs; EOS,
stop ids and max_new_tokens end a request; a finished request's pages go to the tree."""

from __future__ import annotations

import msgspec

from engine.sched.request import Req, Status
from engine.sched.state import RequestKV, SchedState
from msgs.codec import unpack_f32, unpack_ids
from msgs.done import SpecDone, StepDone
from msgs.outputs import ReqOutput


class OutputProcessor:
    def __init__(self, state: SchedState, kv: RequestKV) -> None:
        self.s = state
        self.kv = kv

    def on_tokens(self, done: StepDone, reqs: list[Req], drafts: list[int] | None = None) -> list[ReqOutput]:
        """One output per request that sampled in this step (in the forward's order)."""
        if drafts is not None:
            if not isinstance(done, SpecDone):
                raise RuntimeError(f"step {done.seq} verified drafts but its StepDone says nothing of them")
            return self._on_verified(done, reqs, drafts)
        tokens = unpack_ids(done.token_ids)
        if len(tokens) != len(reqs):
            raise RuntimeError(f"step {done.seq}: {len(tokens)} tokens for {len(reqs)} requests")
        logprobs = unpack_f32(done.logprobs) if done.logprobs is not None else None
        top = _top_rows(done)
        outs = []
        for i, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
            req.inflight -= 1
            if req.status == Status.FINISHED:
                continue  # finished at an earlier step; this overlap token is discarded
            if req.max_new_tokens == 0:
                outs.append(self._scored_only(req))
                continue
            req.output_ids.append(tok)
            out = ReqOutput(
                rid=req.rid,
                new_ids=[tok],
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                completion_tokens=len(req.output_ids),
                logprobs=[logprobs[i]] if logprobs is not None and req.params.logprobs else None,
                top_logprobs=[top[i][: req.params.top_logprobs]] if top and req.params.top_logprobs else None,
            )
            out = self._with_prompt(req, out)
            reason = self._stop_reason(req, tok)
            if reason:
                self.finish(req, reason)
                out = msgspec.structs.replace(out, finish_reason=reason)
            outs.append(out)
        return outs

    def on_prompt_scores(self, done: StepDone, scored: list[tuple[Req, int, int]]) -> None:
        """Forward.prompt's rows: (req, start, n) scored prompt tokens start + 1 .. start + n."""
        lps = unpack_f32(done.prompt_logprobs or b"")
        k = done.prompt_top_k
        ids, tops = unpack_ids(done.prompt_top_ids or b""), unpack_f32(done.prompt_top_logprobs or b"")
        if len(lps) != sum(n for _, _, n in scored) or len(ids) != len(tops) or len(ids) != len(lps) * k:
            raise RuntimeError(f"step {done.seq}: {len(lps)} prompt logprobs for {sum(n for _, _, n in scored)} tokens")
        off = 0
        for req, start, n in scored:
            if req.status != Status.FINISHED:
                if req.prompt_scores is None:
                    req.prompt_scores = [None] * (len(req.prompt_ids) - 1)
                want = req.params.prompt_logprobs or 0
                for i in range(off, off + n):
                    top = list(zip(ids[i * k : i * k + want], tops[i * k : i * k + want], strict=True))
                    req.prompt_scores[start + i - off] = (lps[i], top)
            off += n

    def _scored_only(self, req: Req) -> ReqOutput:
        """The answer of a request that only scored its prompt (max_tokens 0 with prompt logprobs): no
        token, its scores, finished."""
        return self._with_prompt(req, self.finish(req, "length"))

    def _with_prompt(self, req: Req, out: ReqOutput) -> ReqOutput:
        """The first output of a request that scores its prompt carries the scores (its final
        one where it asked for no tokens)."""
        if req.params.prompt_logprobs is None or len(req.output_ids) != min(1, req.max_new_tokens):
            return out
        scores = req.prompt_scores or []
        if len(scores) != len(req.prompt_ids) - 1 or any(s is None for s in scores):
            raise RuntimeError(f"request {req.rid} answered before its prompt was scored")
        return msgspec.structs.replace(out, prompt_logprobs=[s[0] for s in scores if s],
                                       prompt_top_logprobs=[s[1] for s in scores if s] if req.params.prompt_logprobs
                                       else None)

    def _on_verified(self, done: SpecDone, reqs: list[Req], drafts: list[int]) -> list[ReqOutput]:
        """A verify step: each request answered accepted + 1 tokens. Its KV is trimmed to
        what was accepted, then the tokens are taken one by one until a stop condition, so
        stop ids, EOS and max_new_tokens end it exactly where a one-token step would."""
        tokens, accepted = unpack_ids(done.token_ids), unpack_ids(done.accepted)
        if len(accepted) != len(reqs) or len(tokens) != sum(accepted) + len(reqs):
            raise RuntimeError(f"step {done.seq}: {len(tokens)} tokens, {len(accepted)} counts, {len(reqs)} requests")
        logprobs = unpack_f32(done.logprobs) if done.logprobs is not None else None
        top = _top_rows(done)
        outs, off = [], 0
        for req, k, a in zip(reqs, drafts, accepted, strict=True):
            if a > max(k, 0) or a < -1:
                raise RuntimeError(f"step {done.seq}: {a} drafts accepted of {k}")
            lo, off = off, off + a + 1
            req.inflight -= 1
            if k >= 0 and not self._verified(done.seq, req, a):
                continue  # a chained row after a rejection: it answered nothing
            if req.status == Status.FINISHED:
                continue  # finished (or aborted) meanwhile: its tokens are discarded
            if req.max_new_tokens == 0:
                outs.append(self._scored_only(req))
                continue
            if k > 0:
                self.s.spec_stats.add(k, a)  # the drafter's acceptance, whatever a stop then cut
            elif k == 0:
                self.s.spec_stats.empty += 1
            out = self._with_prompt(req, self._take(req, tokens[lo:off], logprobs[lo:off] if logprobs is not None
                                                    else None, top[lo:off] if top else None))
            if k > 0:  # the request's own count: accepted drafts that are in its answer (OpenAI's
                v, d, acc = req.spec  # accepted_prediction_tokens), not those after a stop
                req.spec = (v + 1, d + k, acc + min(a, len(out.new_ids)))
                out = msgspec.structs.replace(out, spec=req.spec)
            outs.append(out)
        return outs

    def _verified(self, seq: int, req: Req, accepted: int) -> bool:
        """req's oldest verify row in flight answered `accepted` drafts (-1: none, it was void);
        whether it answered tokens. A rejection voids the row chained on it (planned as if all
        were accepted) and trims req's KV back to what was accepted, the chained row's included.
        The worker decides voidness on its own (engine/run/spec.py); the two must agree."""
        row = req.verifies.pop(0)
        if row.void != (accepted < 0):
            raise RuntimeError(f"step {seq}: request {req.rid}'s chained row answered {accepted}, "
                               f"the scheduler expected {'nothing' if row.void else 'tokens'}")
        if row.void:
            self.s.spec_stats.void += 1
            return False
        req.full_streak = req.full_streak + 1 if accepted == len(row.drafts) else 0
        if accepted < len(row.drafts):
            for later in req.verifies:
                later.void = True
            if req.status == Status.RUNNING:  # (a retracted request holds no KV to trim)
                self.kv.trim(req, req.kv_len - (row.start + 1 + accepted))
        return True

    def _take(self, req: Req, toks: list[int], lps: list[float] | None,
              top: list[list[tuple[int, float]]] | None) -> ReqOutput:
        """Append tokens to req up to the first that ends it; its output."""
        reason = None
        n = 0
        for tok in toks:
            req.output_ids.append(tok)
            n += 1
            reason = self._stop_reason(req, tok)
            if reason:
                break
        out = ReqOutput(
            rid=req.rid,
            new_ids=toks[:n],
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            logprobs=lps[:n] if lps is not None and req.params.logprobs else None,
            top_logprobs=[t[: req.params.top_logprobs] for t in top[:n]] if top and req.params.top_logprobs else None,
            spec=req.spec if req.spec[0] else None,
        )
        if reason:
            self.finish(req, reason)
            out = msgspec.structs.replace(out, finish_reason=reason)
        return out

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        p = req.params
        # A grammar ends only on one of its stop tokens (xgrammar accepts nothing else once the
        # document is complete), so stopping on them is grammar termination, ignore_eos or not.
        if p.grammar is not None and tok in p.grammar.stop_ids:
            return "stop"
        if len(req.output_ids) > p.min_new_tokens:  # the sampler masked them before (min_stop_ids)
            if not p.ignore_eos and tok in self.s.cfg.eos_token_ids:
                return "stop"
            if tok in p.stop_token_ids:
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def finish(self, req: Req, reason: str) -> ReqOutput:
        """End req (any state): its full pages enter the tree, the rest is freed, FreeReq queued."""
        s = self.s
        if req.status == Status.RUNNING:
            self.kv.publish(req, req.kv_len)
            self.kv.release(req)
            self.kv.release_slot(req, s.pending_ops)
            s.running.remove(req)
        elif req.status == Status.WAITING and req in s.waiting:
            s.waiting.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        del s.reqs[req.rid]
        return ReqOutput(
            rid=req.rid,
            new_ids=[],
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            spec=req.spec if req.spec[0] else None,
        )


def _top_rows(done: StepDone) -> list[list[tuple[int, float]]] | None:
    if done.top_ids is None or done.top_logprobs is None or done.top_k == 0:
        return None
    ids, lps, k = unpack_ids(done.top_ids), unpack_f32(done.top_logprobs), done.top_k
    return [list(zip(ids[i : i + k], lps[i : i + k], strict=True)) for i in range(0, len(ids), k)]
