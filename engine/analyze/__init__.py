"""bin/analyze LOGDIR: read the JSON-lines logs of `bin/serve --log-dir DIR` and print request
timelines (received, queued, first token, done), TTFT / E2E percentiles, TTFT by the tier that
served the prefix, prefix-cache hit rates, host-tier (L2) activity (backup and load-back counts,
bytes and GB/s from the workers' `host copies` lines), disk-tier (L3) loads (the scheduler's
`l3 load` lines) and writes (count, GB, GB/s from the cache controller's `l3 writes` lines), cache
occupancy (peak and last L1 / L2 pages used, L3 bytes, from the scheduler's `cache occupancy`
lines), and every error line with the first step seq it mentions. `--json` prints the same summary
as JSON; `--plot OUT_DIR` writes PNGs (TTFT by tier, TTFT over time, and cache occupancy over time
when the logs carry it: scheduler lines with kv_pages_used / l2_pages_used fields).

Only what the logs carry is reported; what they do not carry is said so in `notes`.
No torch import: this runs anywhere the logs can be copied to."""

from engine.analyze.render import plot, print_text, to_json
from engine.analyze.report import Report, Request, analyze, load, percentile

__all__ = ["Report", "Request", "analyze", "load", "main", "percentile", "plot", "print_text", "to_json"]


def main(argv: list[str] | None = None) -> int:
    from engine.analyze.__main__ import main as run

    return run(argv)
