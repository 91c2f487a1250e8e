"""Which pieces a served engine's backups split into (issue 10): the default model on CPU
with the host tier on, stepped by the differential test's in-process engine (scheduler core,
runner, cache controller, real slab), 16 prompts of 100-400 tokens; prints each backup run's
`_segments` (pages per piece, and whether it is copied straight or gathered).

    python scripts/backup_pieces.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests" / "cache")]

import test_tier_differential as engine_harness  # noqa: E402

from engine.cache.slab import create_slab, remove_slab  # noqa: E402
from engine.config import ServerConfig  # noqa: E402
from engine.run import host_tier  # noqa: E402
from models.default_model import ensure_default_model  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402


def main() -> None:
    engine_harness.GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    seen: list[tuple[int, list[tuple[int, int, int | None]]]] = []
    segments = host_tier._segments

    def record(pages: list[int]) -> list[tuple[int, int, int | None]]:
        out = segments(pages)
        seen.append((len(pages), out))
        return out

    host_tier._segments = record
    slab = create_slab("strata-backup-pieces")
    try:
        cfg = ServerConfig(model=str(ensure_default_model()), device="cpu", dtype="float32",
                           max_total_tokens=16 * 400, max_running_requests=16, max_prefill_tokens=1024,
                           cpu_threads=2, enable_hierarchical_cache=True, hicache_path=slab)
        rng = random.Random(0)
        prompts = [[rng.randrange(200, 20000) for _ in range(rng.randrange(100, 400))] for _ in range(16)]
        engine_harness.Engine(cfg).run(prompts)
    finally:
        remove_slab(slab)
    for n, pieces in seen:
        shown = ", ".join(f"{count}{'' if first is None else ' straight'}" for _, count, first in pieces)
        print(f"run of {n} pages: {len(pieces)} pieces ({shown})")


if __name__ == "__main__":
    main()
