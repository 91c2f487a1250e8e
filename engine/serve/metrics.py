"""Prometheus metrics served at /metrics.

Counters and TTFT are measured in this process; gauges and the step-time histogram come
from the scheduler's SchedulerStats. Each `Metrics` has its own registry so tests can
build as many as they like.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from msgs.codec import DROPPED
from msgs.outputs import SchedulerStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
GRAMMAR_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ACCEPT_BUCKETS = tuple(float(n) for n in range(1, 18))  # tokens a verify row answers: 1 + drafts accepted
# up to 30 s: a CPU's 2k-token prefill chunk takes seconds (an audit saw 6.4 s land in +Inf)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                5, 10, 30)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("strata_requests", "Requests sent to the scheduler (n > 1 counts n)", registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens sent to the scheduler (n > 1 counts "
                                     "the prompt n times, as vLLM)", registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("strata_requests_finished", "Requests (choices) ended, by finish reason "
                                "(stop, length, abort: /abort_request, cancelled: the client left, error)",
                                ["reason"], registry=r)
        self.rejected = Counter("strata_requests_rejected", "Requests refused before they ran, by HTTP status",
                                ["status"], registry=r)
        self.cache_hit_tokens = Counter(
            "strata_cache_hit_tokens", "Prompt tokens served from the prefix cache", ["tier"], registry=r
        )
        self.kv_pages_used = Gauge("strata_kv_pages_used", "KV pages held by requests or the cache", registry=r)
        self.kv_pages_total = Gauge("strata_kv_pages_total", "KV pages in the device pool", registry=r)
        self.kv_pages_used_by_cp_rank = Gauge(
            "strata_kv_pages_used_by_cp_rank", "KV pages used in each context-parallel rank's pool", ["cp_rank"],
            registry=r)
        self.kv_cache_pages = Gauge("strata_kv_cache_pages", "KV pages held by the prefix cache", registry=r)
        self.kv_usage = Gauge("strata_kv_usage", "Fraction of the KV pool that requests hold: the prefix cache's "
                              "evictable pages count as free (SGLang's token_usage)", registry=r)
        self.running = Gauge("strata_running_requests", "Requests being decoded or prefilled", registry=r)
        self.waiting = Gauge("strata_waiting_requests", "Requests queued in the scheduler", registry=r)
        self.leak_free = Gauge("strata_kv_leak_free", "1 when the last idle leak check passed", registry=r)
        self.ttft = Histogram("strata_ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r)
        self.step = Histogram("strata_step_seconds", "Scheduler step duration", buckets=STEP_BUCKETS, registry=r)
        # per request (choice) that finished with an output: vLLM's e2e_request_latency_seconds,
        # request_time_per_output_token_seconds, request_prompt_tokens and request_generation_tokens
        self.e2e = Histogram("strata_e2e_request_latency_seconds", "Time from arrival to the last output",
                             buckets=E2E_BUCKETS, registry=r)
        self.tpot = Histogram("strata_time_per_output_token_seconds", "A request's mean time between its output "
                              "tokens after the first (requests of 2+ tokens)", buckets=TPOT_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("strata_request_prompt_tokens", "Prompt tokens of a finished request",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("strata_request_generation_tokens", "Tokens a finished request "
                                                   "generated", buckets=TOKEN_BUCKETS, registry=r)
        self.grammar_compile = Histogram(
            "strata_grammar_compile_seconds", "Grammar compile time (cache misses)", buckets=GRAMMAR_BUCKETS, registry=r
        )
        self.grammar_cache_hits = Counter(
            "strata_grammar_cache_hits", "Constrained requests served by an already compiled grammar", registry=r
        )
        self.grammar_failures = Counter(
            "strata_grammar_failures", "Grammars that failed to compile or timed out (400s)", registry=r
        )
        for tier in ("l1", "l2", "l3"):  # present (at 0) before the first hit
            self.cache_hit_tokens.labels(tier=tier)
        # tier="l1": the device prefix cache; "l2": loaded back from the host tier; "l3": read from disk
        self.l2_pages_used = Gauge("strata_l2_pages_used", "Host-tier (L2) pages holding KV", registry=r)
        self.l2_pages_total = Gauge("strata_l2_pages_total", "Host-tier (L2) pages in the slab", registry=r)
        self.backups = Counter("strata_l2_backups", "KV backups to L2, by result", ["result"], registry=r)
        self.load_backs = Counter("strata_l2_load_backs", "Cached nodes loaded back from L2 to L1", registry=r)
        # the disk tier (L3): hits are tier="l3" above
        self.l3_reads = Counter("strata_l3_reads", "Page files read from L3 and verified", registry=r)
        self.l3_writes = Counter("strata_l3_writes", "Page files written to L3", registry=r)
        self.l3_bytes_read = Counter("strata_l3_read_bytes", "Bytes read from L3 page files", registry=r)
        self.l3_bytes_written = Counter("strata_l3_written_bytes", "Bytes written to L3 page files", registry=r)
        self.l3_corrupt = Counter(
            "strata_l3_corrupt_files", "L3 files rejected (header, length, checksum, foreign model) and removed",
            registry=r,
        )
        self.l3_write_skips = Counter(
            "strata_l3_write_skips", "L3 writes skipped (the writer's queue was over its byte bound)", registry=r
        )
        self.l3_files = Gauge("strata_l3_files", "Page files in the L3 directory", registry=r)
        self.l3_bytes = Gauge("strata_l3_bytes", "Bytes of the page files in the L3 directory", registry=r)
        self._totals: dict[str, int] = {}  # the scheduler's cumulative counts at the last stats (_advance)
        # MoE models (engine/run/expert_counts.py): routed (token, expert) pairs. Per expert summed
        # over the layers and per layer, not per (layer, expert): DeepSeek-V3's 58 x 256 would be
        # 14,848 series; bin/analyze shows the per-layer, per-expert table from the worker's log
        self.expert_tokens = Counter(
            "strata_moe_expert_tokens", "Tokens routed to each expert, summed over the MoE layers", ["expert"],
            registry=r,
        )
        self.layer_tokens = Counter(
            "strata_moe_routed_tokens", "Tokens routed to experts in each MoE layer (top-k per token)", ["layer"],
            registry=r,
        )
        self.layer_imbalance = Gauge(
            "strata_moe_load_imbalance", "Busiest expert's tokens over the mean, per MoE layer, since start (1 = even)",
            ["layer"], registry=r,
        )
        self._expert_totals: dict[int, list[int]] = {}
        self.spec_accept = Histogram(  # speculative decoding: tokens each verify row answered
            "strata_spec_accept_length", "Tokens a speculative verify row answered (1 + drafts accepted)",
            buckets=ACCEPT_BUCKETS, registry=r,
        )
        self._spec_hist: list[int] = []
        self.spec_drafted = Counter(  # accepted / drafted: vLLM's acceptance rate
            "strata_spec_draft_tokens", "Draft tokens proposed to speculative verify rows", registry=r)
        self.spec_accepted = Counter(
            "strata_spec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.spec_empty = Counter(
            "strata_spec_empty_rows", "Speculative verify rows answered with no draft (one token each)", registry=r)
        self.retractions = Counter(
            "strata_retractions", "Running requests whose KV was given back for lack of pages (prefilled again)",
            registry=r)
        self.dropped = _DroppedFrames()
        r.register(self.dropped)

    def on_submit(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def on_finish(self, e2e: float, between: float, prompt_tokens: int, generated: int) -> None:
        """A request's final output: `between` the time from its first output token to its last."""
        self.e2e.observe(e2e)
        if generated > 1:
            self.tpot.observe(between / (generated - 1))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)

    def on_stats(self, stats: SchedulerStats) -> None:
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_total.set(stats.kv_pages_total)
        self.kv_cache_pages.set(stats.cache_pages)
        self.kv_usage.set((stats.kv_pages_used - stats.evictable_pages) / max(stats.kv_pages_total, 1))
        for cp_rank, used in enumerate(stats.kv_pages_used_by_cp_rank or ()):
            self.kv_pages_used_by_cp_rank.labels(cp_rank=str(cp_rank)).set(used)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.leak_free.set(1 if stats.leak_free else 0)
        self.dropped.scheduler = stats.dropped_frames
        for seconds in stats.step_seconds:
            self.step.observe(seconds)
        # The scheduler reports cumulative counts (every tier's hits in cache_hit_tokens);
        # a smaller one means it restarted. L1 is what the host and disk tiers did not serve.
        hits = max(0, stats.cache_hit_tokens - stats.l2_hit_tokens - stats.l3_hit_tokens)
        self._advance("l1_hit_tokens", hits, self.cache_hit_tokens.labels(tier="l1"))
        self._on_tier_stats(stats)
        self._on_spec_stats(stats.spec_accept_hist)
        self._advance("spec_empty_rows", stats.spec_empty_rows, self.spec_empty)
        self._advance("spec_drafted", stats.spec_drafted, self.spec_drafted)
        accepted = sum(n * count for n, count in enumerate(stats.spec_accept_hist))
        self._advance("spec_accepted", accepted, self.spec_accepted)
        self._advance("retractions", stats.retractions, self.retractions)
        if stats.expert_tokens is not None:
            self._on_expert_tokens(stats.expert_tokens)

    def _on_expert_tokens(self, counts: dict[int, list[int]]) -> None:
        """A worker's cumulative per-layer, per-expert counts, turned into counter increments."""
        for layer, now in sorted(counts.items()):
            before = self._expert_totals.get(layer, [0] * len(now))
            if len(before) != len(now) or sum(now) < sum(before):  # another model, or a restart
                before = [0] * len(now)
            for e, (n, b) in enumerate(zip(now, before, strict=True)):
                if n > b:
                    self.expert_tokens.labels(expert=str(e)).inc(n - b)
            if sum(now) > sum(before):
                self.layer_tokens.labels(layer=str(layer)).inc(sum(now) - sum(before))
            if sum(now):
                self.layer_imbalance.labels(layer=str(layer)).set(max(now) * len(now) / sum(now))
            self._expert_totals[layer] = list(now)

    def _on_spec_stats(self, hist: list[int]) -> None:
        """The scheduler's cumulative rows by drafts accepted, observed as accept lengths."""
        before = self._spec_hist if sum(hist) >= sum(self._spec_hist) else []  # smaller: a restart
        for accepted, n in enumerate(hist):
            for _ in range(n - (before[accepted] if accepted < len(before) else 0)):
                self.spec_accept.observe(accepted + 1)
        self._spec_hist = list(hist)

    def _on_tier_stats(self, stats: SchedulerStats) -> None:
        """The scheduler's cumulative host-tier counters, turned into counter increments."""
        if not stats.l2_pages_total:
            return
        self.l2_pages_used.set(stats.l2_pages_used)
        self.l2_pages_total.set(stats.l2_pages_total)
        self.l3_files.set(stats.l3_files)
        self.l3_bytes.set(stats.l3_bytes)
        for key, counter in (
            ("l2_hit_tokens", self.cache_hit_tokens.labels(tier="l2")),
            ("backups_committed", self.backups.labels(result="committed")),
            ("backups_skipped", self.backups.labels(result="skipped")),
            ("load_backs", self.load_backs),
            ("l3_hit_tokens", self.cache_hit_tokens.labels(tier="l3")),
            ("l3_reads", self.l3_reads),
            ("l3_writes", self.l3_writes),
            ("l3_bytes_read", self.l3_bytes_read),
            ("l3_bytes_written", self.l3_bytes_written),
            ("l3_corrupt", self.l3_corrupt),
            ("l3_write_skips", self.l3_write_skips),
        ):
            self._advance(key, getattr(stats, key), counter)

    def _advance(self, key: str, now: int, counter: Counter) -> None:
        """`counter` += what the scheduler's cumulative count `key` grew by since the last stats
        (all of `now` when it is smaller: the scheduler restarted)."""
        before = self._totals.get(key, 0)
        delta = now - before if now >= before else now
        if delta:
            counter.inc(delta)
        self._totals[key] = now

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DroppedFrames(Collector):
    """strata_dropped_frames_total{proc, channel}: malformed frames dropped by this process
    (the codec's count, read at scrape time) and by the scheduler (from its stats)."""

    def __init__(self) -> None:
        self.scheduler: dict[str, int] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "strata_dropped_frames", "Malformed frames dropped, per process and channel", labels=["proc", "channel"]
        )
        for channel, n in sorted(DROPPED.items()):
            family.add_metric(["tokenizer", channel], n)
        for channel, n in sorted(self.scheduler.items()):
            family.add_metric(["scheduler", channel], n)
        yield family
