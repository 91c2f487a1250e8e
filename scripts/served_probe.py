"""One served engine, probed: its KV capacity, a long prompt's time to first token, decode at that
context, greedy tokens to compare with another engine's, and a killed worker (a measurement for
the two-GPU runs of context and expert parallelism, scripts/gpu_two.sh; not in CI).

    python3 scripts/served_probe.py --model configs/llama-3.1-8b --load-format dummy \\
        --server-args "--cp-size 2" [--prompt-len 130816] [--decode-tokens 128] \\
        [--agree 4x2048+16] [--kill-rank 1] [--layers 4] --out FILE
    python3 scripts/served_probe.py --compare A.json B.json     # greedy agreement of two runs

Each part is optional and measured on one `bin/serve` started here (engine/bench/launch.py):
  capacity       strata_kv_pages_total (every rank's pool: at cp=N about N x cp=1's) and max_model_len
  --prompt-len   a fresh random prompt of that many tokens, 1 output token: time to first token
                 (streamed), after an untimed prompt of the same length (nothing compiles in the timed one)
  --decode-tokens the same prompt again (its KV cached), that many tokens streamed: the median time
                 between tokens after the first, i.e. batch-1 decode at that context
  --agree PxL+N  P seeded prompts of L tokens, N greedy tokens each, written to the JSON (ids only)
  --kill-rank R  last: 4 requests in flight, worker rank R killed (SIGKILL); how long until the
                 supervisor exits, whether every client got an error, and whether any process is left
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench import cache, launch  # noqa: E402
from engine.bench.workload import cut_model  # noqa: E402

TIMEOUT_S = 600.0


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def stream_times(url: str, ids: list[int], new: int) -> tuple[list[float], list[int]]:
    """(seconds from the send at which each streamed event brought tokens, token count then)."""
    times, counts = [], []
    for t, data in cache.stream_events(url, ids, new, ignore_eos=True):
        n = data.get("meta_info", {}).get("completion_tokens", 0)
        if n and (not counts or n > counts[-1]):
            times.append(t)
            counts.append(n)
    return times, counts


def greedy(url: str, ids: list[int], new: int) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT_S)
    r.raise_for_status()
    return r.json()["output_ids"]


def capacity(url: str) -> dict[str, Any]:
    m = cache.metrics(url)
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {"kv_pages_total": m.get("strata_kv_pages_total"), "max_model_len": models[0].get("max_model_len")}


def long_prompt(url: str, rng: random.Random, n: int, decode: int) -> dict[str, Any]:
    greedy(url, prompt(rng, n), 1)  # untimed: the first prefill of this length
    ids = prompt(rng, n)
    cache.flush(url, TIMEOUT_S)
    first, _ = stream_times(url, ids, 1)
    out: dict[str, Any] = {"prompt_len": n, "ttft_s": first[0]}
    if decode:
        times, counts = stream_times(url, ids, decode + 1)  # cached: the prefill is its last page
        gaps = [(b - a) / (m - k) for a, b, k, m in zip(times, times[1:], counts, counts[1:], strict=False)]
        out |= {"decode_tokens": counts[-1] - 1, "decode_ms_per_token": 1e3 * statistics.median(gaps),
                "decode_ms_mean": 1e3 * (times[-1] - times[0]) / (counts[-1] - counts[0])}
    return out


def agree(url: str, spec: str, seed: int) -> dict[str, Any]:
    count, rest = spec.split("x")
    length, new = rest.split("+")
    rng = random.Random(seed + 1)
    prompts = [prompt(rng, int(length)) for _ in range(int(count))]
    return {"spec": spec, "tokens": [greedy(url, p, int(new)) for p in prompts]}


def kill_rank(url: str, pid: int, rank: int, rng: random.Random, max_len: int) -> dict[str, Any]:
    """Four long requests in flight, then worker `rank` SIGKILLed: the engine must stop within
    seconds, tell every client, and leave no process."""
    everyone = psutil.Process(pid).children(recursive=True)
    workers = {int(c.cmdline()[c.cmdline().index("--rank") + 1]): c for c in everyone
               if "procs.worker" in c.cmdline()}
    pool = ThreadPoolExecutor(4)
    new = min(4096, max_len - 257)  # requests that run until the kill, not refused for their length
    futs = [pool.submit(greedy, url, prompt(rng, 256), new) for _ in range(4)]
    time.sleep(2.0)
    workers[rank].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    errors = []
    for f in futs:
        try:
            f.result(timeout=60)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - what each client saw
            errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    sup = psutil.Process(pid)
    try:
        sup.wait(timeout=60)
    except psutil.TimeoutExpired:
        pass
    stopped_s = time.monotonic() - t0
    time.sleep(0.5)
    left = [p.cmdline()[:4] for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"rank": rank, "supervisor_exited_s": stopped_s, "client_errors": errors,
            "every_client_told": all(errors), "processes_left": left}


def compare(a: Path, b: Path) -> int:
    ta, tb = json.loads(a.read_text())["agree"]["tokens"], json.loads(b.read_text())["agree"]["tokens"]
    for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
        first = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        same = sum(p == q for p, q in zip(x, y, strict=False))
        print(f"prompt {i}: {same} / {len(x)} equal, first divergence {first}")
    same = ta == tb
    print("greedy tokens equal" if same else "greedy tokens DIFFER")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs=2, type=Path, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--layers", type=int, default=0,
                    help="cut the model to its first N layers (a config copy; with --load-format dummy)")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--agree", default="")
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    rng = random.Random(a.seed)
    rec: dict[str, Any] = {"server_args": a.server_args, "model": a.model, "layers": a.layers}
    model = a.model
    if a.layers:
        tmp = tempfile.TemporaryDirectory(prefix="served-probe-")
        model = cut_model(a.model, a.layers, Path(tmp.name) / Path(a.model).name)

    def save() -> None:
        print(json.dumps({k: v for k, v in rec.items() if k != "agree"}), flush=True)
        if a.out:
            a.out.write_text(json.dumps(rec, indent=1))

    with launch.launched_server(model, a.load_format, shlex.split(a.server_args)) as ep:
        assert ep.http is not None and ep.pid is not None
        rec["capacity"] = capacity(ep.http)
        save()
        if a.prompt_len:
            rec["long"] = long_prompt(ep.http, rng, a.prompt_len, a.decode_tokens)
            save()
        if a.agree:
            rec["agree"] = agree(ep.http, a.agree, a.seed)
            save()
        if a.kill_rank is not None:
            rec["kill"] = kill_rank(ep.http, ep.pid, a.kill_rank, rng, rec["capacity"]["max_model_len"])
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
