"""Command-line flags -> ServerConfig (the only place flags are defined).

Every ServerConfig field is a flag with a help line; `bin/serve --help` shows each default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.config import ServerConfig
from engine.env import env

HIDDEN = ("run_dir", "hicache_path", "served_model_aliases")  # set by the supervisor / parse_args, not by people

HELP = {
    "model": "HF-style model directory, or a Hugging Face hub id (Org/Name: the HF cache first, then a download) "
    "(empty: SmolLM2-135M-Instruct, converted on first run)",
    "served_model_name": "the model name the API reports and accepts (empty: the model directory's name); more "
    "names after it are accepted too and listed by /v1/models (vLLM's `--served-model-name a b`)",
    "load_format": "auto | safetensors | dummy (random weights from config.json; quantized as the config says)",
    "quantization": "fp8: quantize a bf16 checkpoint's projections to e4m3 per output channel at load (dynamic "
    "per-token activations), as vLLM/SGLang's --quantization fp8. Quantized checkpoints (fp8 block, "
    "compressed-tensors FP8, ModelOpt FP8/NVFP4) need no flag: their config says. On CPU weights are dequantized",
    "host": "address HTTP and the SDK listen on (127.0.0.1: this machine only)",
    "port": "HTTP port (OpenAI API, /generate, /health, /metrics)",
    "sdk_port": "TCP port of the ZMQ client SDK",
    "allowed_origins": "CORS for browser clients: origins allowed to call the HTTP API, comma-separated, or * for "
    "any (vLLM's --allowed-origins; its preflights pass --api-key, their requests do not) (empty: no CORS "
    "headers, browsers on other origins are refused)",
    "api_key": "require this key: HTTP requests as `Authorization: Bearer KEY` (all but /health, /health_generate "
    "and /metrics: a 401 without it), SDK requests as Client(addr, api_key=KEY) (not given: STRATA_API_KEY, "
    "else no key; an empty one: no key)",
    "log_dir": "write one JSON-lines log file per process here (empty: stderr only)",
    "device": "auto (cuda when available) | cpu | cuda",
    "dtype": "weights and activations: auto (bfloat16 on GPU, and on a CPU with native bf16, AVX512-BF16 or AMX, "
    "when deterministic; else float32) | float32 | bfloat16 | float16",
    "attention_backend": "auto (flashinfer on CUDA, torch on CPU) | torch | flashinfer",
    "kv_cache_dtype": "auto (the model dtype) | fp8_e4m3: KV stored in 8-bit floats, half the bytes (lossy)",
    "attention_fp8_math": "with an fp8 KV cache on SM90, decode attention in fp8 tensor-core math (queries and "
    "probabilities rounded to e4m3, as FA3/TensorRT-LLM fp8 attention do): ~2x faster decode attention, less precise",
    "tp_size": "tensor-parallel ranks, one worker process (and one GPU: cuda:LOCAL_RANK) each; gloo on CPU, "
    "NCCL on GPU",
    "ep_size": "expert parallelism for MoE models: 1 (every rank a slice of every expert) or --tp-size (whole "
    "experts per rank, E / --ep-size each; must divide the experts); attention stays tensor-parallel",
    "cp_size": "context parallelism: each request's KV pages spread round robin over --cp-size rank groups "
    "(1/cp of the KV per rank, attention merged by log-sum-exp); --tp-size x --cp-size workers, tp innermost",
    "nnodes": "nodes the --tp-size x --cp-size ranks are spread over, (tp x cp)/--nnodes workers each (as in "
    "SGLang); run bin/serve on every node with the same flags but --node-rank",
    "node_rank": "this node's index in 0..--nnodes-1 (node 0 runs the scheduler and tokenizer; others only workers)",
    "dist_init_addr": "HOST:PORT of node 0: torch.distributed's rendezvous on PORT, and with --nnodes > 1 the "
    "Step stream and done channels on PORT+1..PORT+1+world (world: --tp-size x --cp-size), bound on HOST by node "
    "0's scheduler (workers of every node connect); required with --nnodes > 1 (empty: 127.0.0.1 and a free port)",
    "page_size": "tokens per KV page, the prefix cache's granularity (a power of 2; 0: auto, 64 for MLA models "
    "on CUDA, FlashMLA's page, else 16)",
    "max_total_tokens": "cap the KV pool at this many tokens (0: sized from free memory on GPU, from the model "
    "and the machine on CPU); per cp rank at --cp-size > 1, so the engine holds cp x N",
    "mem_fraction": "share of free GPU memory, after the weights load, for the KV pool and runtime buffers",
    "max_running_requests": "most requests in the running batch at once (also the largest CUDA graph's rows; times "
    "--speculative-num-draft-tokens with speculative chains)",
    "max_prefill_tokens": "token budget per step; longer prompts are prefilled in chunks",
    "scheduling_policy": "fcfs: requests admitted in arrival order | priority (vLLM's): by each request's "
    "`priority` (lower first; ties by arrival), and the last of that order retracted first when KV runs out",
    "context_length": "max prompt + output tokens per request (0: the model's max_position_embeddings; no more "
    "than it)",
    "watchdog_timeout": "seconds a step may go unfinished on every rank, or the scheduler's or tokenizer's loop "
    "may go silent, before the server stops (every request in flight then fails with a 503), instead of hanging",
    "disable_overlap": "run each step to completion before planning the next (no one-step-ahead scheduling)",
    "disable_radix_cache": "do not reuse KV pages of shared prompt prefixes across requests",
    "disable_cuda_graph": "decode without CUDA graphs (eager kernels every step)",
    "enable_deterministic_inference": "one request, one answer: its logits bit for bit whatever its batch, cached "
    "prefix (any tier), prefill chunks or overlap (batch-invariant GEMMs; attention by one path: a C kernel on a "
    "CPU, our triton kernel on CUDA, under the torch attention backend). The flag's default shows False, but on a "
    "CPU the mode is on unless --disable-deterministic-inference, draft trees, --cp-size > 1 or another attention "
    "backend (no measurable cost there, float32 or bf16); on a GPU it costs throughput (H200: ~8-10%% offline; "
    "Llama-3.1-8B's batch-1 step 1.06x on an H100, 1.14x on an H200): docs/PERF.md",
    "disable_deterministic_inference": "on a CPU, turn off its default deterministic inference (draft trees, "
    "--speculative-eagle-topk > 1, --cp-size > 1 and another attention backend turn it off too)",
    "batch_wait_ms": "when requests reach an idle engine, its first step waits until none has arrived for this "
    "long (at most 10x in all), so that a burst sent at once is prefilled as one batch, not as what came first "
    "and then the rest (-1: auto = 2 on CPU, where a prefill step takes 100s of ms; 0 on GPU: no wait)",
    "seed": "seed for requests that give none (each gets a fresh seed drawn from this)",
    "cpu_threads": "torch threads of a CPU worker (0: every core this process may run on; OpenMP threads wait "
    "passively unless OMP_WAIT_POLICY is set)",
    "decode_kernel": "decode attention kernel on GPU: auto (the GPU's tuning file) | fa2 | xqa | triton; for debugging",
    "grammar_helpers": "processes per rank that run the grammar matchers of structured output (xgrammar holds the "
    "GIL; helpers accept a step's tokens in parallel): -1 = auto (GPU: min(8, cores / 2); CPU: 0, in the worker)",
    "grammar_backend": "structured output (json_schema, regex, ebnf, structural tags, forced tool calls): xgrammar, "
    "started with the server, so the first constrained request compiles only its grammar | none (refused with a 400; "
    "no grammar process runs)",
    "enable_hierarchical_cache": "keep prefix-cache KV in a host-memory tier (L2, one shared-memory slab) when "
    "it leaves the GPU, and load it back on a match instead of recomputing it",
    "hicache_ratio": "L2 size as a multiple of the device KV pool (with --enable-hierarchical-cache)",
    "hicache_size": "L2 size in GB; overrides --hicache-ratio when > 0",
    "hicache_write_policy": "when cached KV is copied to L2: write_through (as it enters the cache) | "
    "write_through_selective (on its second hit); write_back is not implemented yet",
    "l3_dir": "keep prefix-cache KV as files in this directory too (the disk tier, L3; with "
    "--enable-hierarchical-cache): it survives restarts and may be shared by several engines of the same model; "
    "/flush_cache does not delete it (empty: off)",
    "l3_size": "cap, in GB, on the L3 files in --l3-dir; the oldest are removed first",
    "tool_call_parser": "parse tool calls out of chat output (message.tool_calls): hermes | qwen25 | llama3 | "
    "deepseek_v3 | deepseek_v31 | glm45 (empty: tools are only rendered into the prompt; tool_choice required "
    "or a named function is refused)",
    "reasoning_parser": "split <think>...</think> into reasoning_content: deepseek-r1 | qwen3 | glm45 "
    "(empty: the reasoning stays in content)",
    "speculative_algorithm": "speculative decoding (as SGLang's flag): NGRAM (drafts from the prefix cache's "
    "continuation of the request's tokens, else looked up in the request's own tokens) | STANDALONE (a draft "
    "model: --speculative-draft-layers N or --speculative-draft-model-path) | EAGLE, EAGLE3 (a head fed the "
    "model's hidden states: --speculative-draft-model-path) | NEXTN (DeepSeek-V3's own MTP layer) (empty: off)",
    "speculative_num_steps": "draft tokens proposed per request and step (0: 3 when speculation is on)",
    "speculative_num_draft_tokens": "tokens verified per request and step; a chain: --speculative-num-steps + 1 "
    "(0: that)",
    "speculative_eagle_topk": "drafts per position: 1: chains; K > 1: draft trees of --speculative-num-draft-tokens "
    "nodes (more than --speculative-num-steps + 1, at most 64), not with --enable-deterministic-inference (on a "
    "CPU they turn its default off)",
    "speculative_draft_model_path": "STANDALONE: a separate draft model's directory, with the target's tokenizer "
    "(its own KV pool over the target's pages); EAGLE, EAGLE3: the head's directory (HF EAGLE / EAGLE-3 format)",
    "speculative_corrupt_drafts": "NGRAM, for benchmarks (bin/bench spec --corrupt): each looked-up draft is "
    "replaced by a wrong token with this chance, seeded by request and position (0: off)",
    "speculative_num_steps_by_batch_size": "drafts per row by the step's decode rows: ROWS:STEPS,... (ROWS "
    "ascending): a step of more than ROWS decode rows gives each at most STEPS drafts (0: a plain decode step, no "
    "speculation); the default is chosen from an H200 sweep (docs/PERF.md); empty: --speculative-num-steps at "
    "every batch size (as vLLM's --speculative-disable-by-batch-size N is N:0)",
    "speculative_draft_layers": "STANDALONE self-draft: the target's first N layers plus its final norm and head "
    "draft; their KV is the target's own (0: off)",
    "sampling_defaults": "model: a request's unset temperature, top_p, top_k, min_p and repetition_penalty are "
    "those the model's generation_config.json sets (as SGLang and vLLM do) | openai: always OpenAI's (1, 1, off, 0, 1)",
    "chat_template": "a Jinja chat template file to use instead of the model's own (e.g. "
    "configs/templates/smollm2-hermes-tools.jinja: the default model with Hermes-style tools)",
    "trust_request_chat_template": "render a chat request's own `chat_template` (a Jinja text, in a sandbox) instead "
    "of the server's (vLLM's flag: off, such a request is a 400, since a template is code its sender runs here)",
}


# SGLang's and vLLM's names for the same flags: accepted as they are (whole names only: no abbreviations)
ALIASES = {
    "model": ("--model-path",),
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "context_length": ("--max-model-len",),
    "max_running_requests": ("--max-num-seqs",),
    "max_prefill_tokens": ("--chunked-prefill-size", "--max-num-batched-tokens"),
    "seed": ("--random-seed",),
    "disable_cuda_graph": ("--enforce-eager",),
}
# their flags with no twin here: what to use instead (an exit 2 that says so, not "unrecognized arguments")
FOREIGN = {
    "--mem-fraction-static": "--mem-fraction (the share of free GPU memory after the weights load)",
    "--gpu-memory-utilization": "--mem-fraction (the share of free GPU memory after the weights load)",
    "--log-level": "the STRATA_LOG_LEVEL environment variable",
    "--trust-remote-code": "nothing: no model code from a checkpoint runs here (drop the flag)",
    "--enable-metrics": "nothing: /metrics is always served (drop the flag)",
    "--enable-prefix-caching": "nothing: the prefix cache is on by default (--disable-radix-cache turns it off)",
    "--tokenizer-path": "the tokenizer in the --model directory",
    "--tokenizer": "the tokenizer in the --model directory",
    "--dp": "one engine per data-parallel replica (data parallelism is not built in)",
    "--dp-size": "one engine per data-parallel replica (data parallelism is not built in)",
    "--data-parallel-size": "one engine per data-parallel replica (data parallelism is not built in)",
    "--schedule-policy": "nothing: requests are scheduled first come, first served",
}


# value spellings SGLang and vLLM take for ours
SPELLINGS = {
    "dtype": {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"},
    "kv_cache_dtype": {"fp8": "fp8_e4m3"},
}


def _canonical(ns: argparse.Namespace) -> None:
    for name, spellings in SPELLINGS.items():
        setattr(ns, name, spellings.get(getattr(ns, name), getattr(ns, name)))
    ns.speculative_algorithm = ns.speculative_algorithm.upper()  # (SGLang's are upper case; `ngram` is the same)


def _refuse_foreign(argv: list[str]) -> None:
    """Exit 2 naming the Strata way for another server's flag (it would be "unrecognized")."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in FOREIGN:
            print(f"bin/serve: error: {name} is another server's flag; here use {FOREIGN[name]}", file=sys.stderr)
            raise SystemExit(2)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default == "":
            return f"{action.help} (default: empty)"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations (`--tp` once matched --tp-size by prefix: only whole names, ALIASES, count)
    parser = argparse.ArgumentParser(prog="bin/serve", description="Strata LLM server", formatter_class=_Formatter,
                                     allow_abbrev=False)
    for f in dataclasses.fields(ServerConfig):
        if f.name in HIDDEN:
            continue
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(*flags, action="store_true", help=HELP[f.name])
        elif f.name == "served_model_name":  # one name or more (vLLM's)
            parser.add_argument(*flags, nargs="+", default=[default], metavar="NAME", help=HELP[f.name])
        else:
            parser.add_argument(*flags, type=type(default), default=default, help=HELP[f.name])
    return parser


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """The command line (and the STRATA_* environment, read once here: a bad value is an exit 2
    naming the variable, as a bad flag is)."""
    given = sys.argv[1:] if argv is None else argv
    _refuse_foreign(given)
    ns = build_parser().parse_args(argv)
    _canonical(ns)
    ns.served_model_name, *aliases = ns.served_model_name
    ns.served_model_aliases = tuple(aliases)
    # `--api-key ""` given: no key, whatever STRATA_API_KEY says (an audit could not turn it off)
    key_given = any(a == "--api-key" or a.startswith("--api-key=") for a in given)
    try:
        variables = env()
        if not key_given and variables.api_key:  # the environment keeps it out of `ps`
            ns.api_key = variables.api_key
        return ServerConfig(**vars(ns))
    except ValueError as exc:
        print(f"strata: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
