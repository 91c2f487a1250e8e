"""Server configuration: one frozen dataclass, validated on construction, passed to every
child process as JSON (`to_json` / `from_json`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from msgs.channels import TcpPlan


MAX_SPEC_STEPS = 16  # drafts a row and step, at most
# --speculative-num-steps-by-batch-size's default, from the H200 sweep in docs/PERF.md (Speculation by
# batch size): more than 4 decode rows, at most 3 drafts a row; more than 16, no speculation
SPEC_BY_BATCH_DEFAULT = "4:3,16:0"


GRAMMAR_BACKENDS = ("xgrammar", "none")  # --grammar-backend
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # engine/layers/attention.py's _BACKENDS, and auto
MAX_RUNNING_REQUESTS = 4096  # --max-running-requests' bound: 100,000 slots of a 49k vocabulary took 24 GB

@dataclass(frozen=True)
class ServerConfig:
    model: str = ""  # HF-style directory or hub id (engine/hub.py); "" = the default SmolLM2 model
    served_model_name: str = ""
    # more names requests may use for the model (vLLM's `--served-model-name a b`: the first reported, all
    # accepted and listed by /v1/models); set from --served-model-name's names after its first
    served_model_aliases: tuple[str, ...] = ()
    load_format: str = "auto"  # auto | safetensors | dummy
    quantization: str = ""  # "" (the checkpoint's own) | fp8 (a plain checkpoint quantized per channel at load)
    host: str = "127.0.0.1"
    port: int = 8000
    sdk_port: int = 8001
    api_key: str = ""  # every SDK request and HTTP route but /health, /health_generate and /metrics must carry it
    allowed_origins: str = ""  # CORS: browser origins allowed to call the HTTP API, comma-separated ("*": any)
    run_dir: str = ""  # private dir for ipc sockets; chosen by the supervisor
    log_dir: str = ""
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (= --dtype) | fp8_e4m3 (half the KV bytes; lossy)
    attention_fp8_math: bool = False  # fp8 KV: attend in fp8 tensor-core math (SM90 XQA), q/probs rounded
    tp_size: int = 1  # tensor-parallel ranks over all nodes, one worker process each
    ep_size: int = 1  # expert-parallel ranks: 1, or --tp-size (whole MoE experts per rank)
    cp_size: int = 1  # context-parallel ranks: world = tp_size x cp_size workers (docs/architecture.md)
    nnodes: int = 1
    node_rank: int = 0
    # host:port of rank 0's torch.distributed store ("": 127.0.0.1, a free port); with nnodes > 1
    # required, and ports port+1 .. port+1+tp_size carry the Step stream and `done` (TcpPlan)
    dist_init_addr: str = ""
    page_size: int = 0  # tokens a KV page; 0 = auto (`_check_page_size`: 64 for MLA models on CUDA, else 16)
    max_total_tokens: int = 0  # KV pool capacity in tokens; 0 = size from free memory
    mem_fraction: float = 0.85
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # token budget per step (chunked prefill splits above it)
    # fcfs: requests in arrival order; priority (vLLM's): by their `priority` (lower first), then arrival
    scheduling_policy: str = "fcfs"
    # an idle engine's first step waits for a burst's stragglers: until no request came for this long
    # (at most BURST_WAIT_CAP x it in all); -1 = auto (CPU 2 ms, where a step takes 100s of ms; GPU 0: none)
    batch_wait_ms: float = -1.0
    context_length: int = 0  # 0 = the model's max_position_embeddings
    # a step no rank has finished for this long: the scheduler stops the server (as SGLang's), never hangs
    watchdog_timeout: float = 300.0
    disable_overlap: bool = False
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    # a request's logits independent of its batch, cache hits, chunks, overlap (engine/layers/batch_invariant.py):
    # on a CPU by default (`deterministic`), on a GPU with the flag
    enable_deterministic_inference: bool = False
    disable_deterministic_inference: bool = False  # the CPU's opt-out
    seed: int = 0
    cpu_threads: int = 0  # torch intra-op threads of a CPU worker; 0 = every core this process may use
    decode_kernel: str = "auto"  # auto (the GPU's tuning file) | fa2 | xqa | triton: override for debugging
    grammar_helpers: int = -1  # grammar matcher processes per rank; -1 = auto (GPU: min(8, cores/2); CPU: 0)
    # structured output's engine (SGLang's flag): xgrammar, started with the server (ready means warm), or
    # none: constrained requests are refused and no grammar process runs
    grammar_backend: str = "xgrammar"
    tool_call_parser: str = ""  # "" = tools are only rendered into the prompt; see engine/serve/parsers
    reasoning_parser: str = ""  # "" = <think> blocks stay in the content
    chat_template: str = ""  # a Jinja file replacing the model's chat template ("" = the model's)
    trust_request_chat_template: bool = False  # a chat request's own `chat_template` is rendered (vLLM's flag)
    # what a request's unset temperature / top_p / top_k / min_p / repetition_penalty are: "model" (its
    # generation_config.json's, where it sets them; else OpenAI's) | "openai" (SGLang's flag)
    sampling_defaults: str = "model"
    # the host tier (L2, docs/architecture.md: Tiers): opt-in, as SGLang's --enable-hierarchical-cache
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # L2 pages = this x the device pool's pages
    hicache_size: float = 0.0  # GB of host slab; > 0 overrides the ratio
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective (| write_back: not yet)
    hicache_path: str = ""  # the host slab's shared-memory file; created by the supervisor
    # the disk tier (L3): page files under this directory, shared by engines and restarts
    l3_dir: str = ""  # "": off; needs --enable-hierarchical-cache
    l3_size: float = 16.0  # GB cap on the files in l3_dir (oldest removed first)
    # speculative decoding (docs/architecture.md, Speculative decoding), SGLang's flag names
    speculative_algorithm: str = ""  # "" (off) | NGRAM | STANDALONE | EAGLE | EAGLE3 | NEXTN
    speculative_num_steps: int = 0  # drafts per row and step (0: a chain's draft tokens - 1, else 3)
    speculative_num_draft_tokens: int = 0  # tokens verified per row: num_steps + 1 for chains (0: that); a tree's nodes
    speculative_eagle_topk: int = 1  # drafts per position: 1 (chains); > 1: NGRAM draft trees (num_steps: their depth)
    speculative_draft_model_path: str = ""  # STANDALONE: a draft model's directory; EAGLE, EAGLE3: the head's
    speculative_draft_layers: int = 0  # STANDALONE self-draft: the target's first N layers + norm + head
    speculative_corrupt_drafts: float = 0.0  # NGRAM, benchmarking: a draft made wrong with this chance (bin/bench spec)
    # drafts per row capped by the step's decode rows: "ROWS:STEPS,...", above ROWS rows at most STEPS
    # (0: plain decode steps); "": every batch size gets --speculative-num-steps (docs/PERF.md, issue 24 item 3)
    speculative_num_steps_by_batch_size: str = SPEC_BY_BATCH_DEFAULT

    def __post_init__(self) -> None:
        for f in fields(self):  # inf would reach the children as JSON null
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        problems = [
            (self.load_format in ("auto", "safetensors", "dummy"),
             f"bad --load-format {self.load_format} (auto, safetensors, dummy)"),
            (self.quantization in ("", "fp8"), f"bad --quantization {self.quantization!r} (choose fp8)"),
            (self.batch_wait_ms == -1 or 0 <= self.batch_wait_ms <= 100,
             f"bad --batch-wait-ms {self.batch_wait_ms} (-1: auto, or 0 to 100)"),
            (self.device in ("auto", "cpu", "cuda"), f"bad --device {self.device} (auto, cpu, cuda)"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"bad --dtype {self.dtype} (auto, float32, bfloat16, float16)"),
            (not (self.enable_deterministic_inference and self.disable_deterministic_inference),
             "--enable-deterministic-inference and --disable-deterministic-inference: choose one"),
            (not self.enable_deterministic_inference or self.attention_backend in ("auto", "torch"),
             "--enable-deterministic-inference needs the torch attention backend (--attention-backend auto or torch)"),
            (self.kv_cache_dtype in ("auto", "fp8_e4m3"),
             f"bad --kv-cache-dtype {self.kv_cache_dtype} (auto, fp8_e4m3)"),
            (self.host.strip() != "", "--host must name an address (127.0.0.1, 0.0.0.0, ::, a hostname)"),
            (all(a.strip() for a in self.served_model_aliases) and len(set(self.served_model_aliases)) ==
             len(self.served_model_aliases), f"bad --served-model-name names {list(self.served_model_aliases)} "
             "(each one non-empty, none twice)"),
            (0 < self.port < 65536, f"bad --port {self.port} (1..65535)"),
            (0 < self.sdk_port < 65536, f"bad --sdk-port {self.sdk_port} (1..65535)"),
            (self.port != self.sdk_port, f"--sdk-port must differ from --port (both {self.port})"),
            (self.page_size >= 0 and self.page_size & (self.page_size - 1) == 0,
             "--page-size must be a power of 2 (or 0: auto)"),
            (self.max_total_tokens >= 0, "--max-total-tokens must be >= 0"),
            (self.scheduling_policy in ("fcfs", "priority"),
             f"bad --scheduling-policy {self.scheduling_policy!r} (fcfs, priority)"),
            (0 < self.mem_fraction <= 1, "--mem-fraction must be in (0, 1]"),
            (1 <= self.max_running_requests <= MAX_RUNNING_REQUESTS,
             f"--max-running-requests must be in 1..{MAX_RUNNING_REQUESTS} (the sampler's per-slot rows of the "
             "vocabulary and the largest CUDA graph are sized by it)"),
            (self.context_length == 0 or self.context_length >= 2,
             f"bad --context-length {self.context_length} (0: the model's, else at least 2 tokens)"),
            (self.attention_backend in ATTENTION_BACKENDS,
             f"bad --attention-backend {self.attention_backend!r} (choose from {', '.join(ATTENTION_BACKENDS)})"),
            (self.watchdog_timeout >= 1, f"bad --watchdog-timeout {self.watchdog_timeout} (seconds, at least 1)"),
            (not self.attention_fp8_math or self.kv_cache_dtype == "fp8_e4m3",
             "--attention-fp8-math needs --kv-cache-dtype fp8_e4m3"),
            (0 <= self.cpu_threads <= 4 * (os.cpu_count() or 1),
             f"--cpu-threads must be in 0..{4 * (os.cpu_count() or 1)} (at most 4 a core of this machine; 0: every "
             "core this process may use)"),
            (-1 <= self.grammar_helpers <= 64, "--grammar-helpers must be -1 (auto) or 0..64"),
            (self.decode_kernel in ("auto", "fa2", "xqa", "triton"),
             f"bad --decode-kernel {self.decode_kernel} (auto, fa2, xqa, triton)"),
            (self.tp_size >= 1, "--tp-size must be >= 1"),
            (self.ep_size in (1, self.tp_size), f"--ep-size {self.ep_size} must be 1 or equal to --tp-size "
             f"{self.tp_size} (the MoE experts are spread over the tensor-parallel ranks)"),
            (self.nnodes >= 1, "--nnodes must be >= 1"),
            (0 <= self.node_rank < max(self.nnodes, 1), "--node-rank must be in 0..--nnodes-1"),
            (self.cp_size >= 1, "--cp-size must be >= 1"),
            (self.world_size % max(self.nnodes, 1) == 0, "--tp-size x --cp-size must be a multiple of --nnodes"),
            (self.cp_size == 1 or not self.speculative_algorithm,
             "--cp-size > 1 with --speculative-algorithm: speculative decoding under context parallelism is not built"),
            (not self.dist_init_addr or _host_port(self.dist_init_addr), "--dist-init-addr must be HOST:PORT"),
        ]
        for ok, problem in problems:
            if not ok:
                raise ValueError(problem)
        self._check_nodes()
        self._check_serving()
        self._check_hicache()
        self._check_spec()
        self._check_model()
        self._check_context_length()
        self._check_page_size()

    def _check_context_length(self) -> None:
        """--context-length no longer than the model's max_position_embeddings (read from its
        config.json here, before any process starts): positions past it were never trained."""

        path = Path(self.model).expanduser() / "config.json" if self.model else None
        if not self.context_length or path is None or not path.is_file():
            return
        most = _read_json(path).get("max_position_embeddings")
        if isinstance(most, int) and self.context_length > most:
            raise ValueError(f"--context-length {self.context_length} exceeds the model's max_position_embeddings "
                             f"({most})")

    def _check_page_size(self) -> None:
        """--page-size 0 (auto) becomes 64 for an MLA model (config.json's kv_lora_rank) on CUDA:
        FlashMLA's page (engine/layers/flash_mla.py), at 1/57 of the KV bytes of expanded heads a
        64-token page is smaller than a Llama page of 16; else 16. Set once here (frozen)."""
        if self.page_size == 0:
            object.__setattr__(self, "page_size", 64 if self._mla_on_cuda() else 16)
        if self.max_prefill_tokens < self.page_size:
            raise ValueError(f"--max-prefill-tokens {self.max_prefill_tokens} must be >= page size {self.page_size}")
        if 0 < self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens {self.max_total_tokens} holds no KV page of {self.page_size} tokens")

    def _mla_on_cuda(self) -> bool:
        """An MLA model (its config.json has kv_lora_rank) served on CUDA (torch asked only then)."""

        path = Path(self.model).expanduser() / "config.json" if self.model else None
        if path is None or not path.is_file() or not _read_json(path).get("kv_lora_rank"):
            return False
        return self.resolved_device == "cuda"

    def _check_model(self) -> None:
        """A hub id (`Qwen/Qwen3-30B-A3B`) becomes its snapshot directory here, once
        (engine/hub.py: the HF cache first, then a download), so every process gets a
        directory; the API then names the model by the id."""
        if not self.model or Path(self.model).expanduser().is_dir():
            return
        from engine.hub import resolve_model

        hub_id = self.model
        object.__setattr__(self, "model", resolve_model(hub_id, self.load_format))  # frozen; set once here
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", hub_id)

    def _check_spec(self) -> None:
        """Speculative decoding's flags, checked together once here: a combination that cannot
        work is a start-up error naming the flag. Defaults are filled in (frozen; set once)."""
        algo = self.speculative_algorithm
        if not algo:
            others = (self.speculative_num_steps, self.speculative_num_draft_tokens, self.speculative_draft_layers,
                      self.speculative_draft_model_path, self.speculative_eagle_topk != 1,
                      self.speculative_corrupt_drafts)
            if any(others):
                raise ValueError("--speculative-num-steps / --speculative-num-draft-tokens / --speculative-eagle-topk "
                                 "/ --speculative-draft-* need --speculative-algorithm")
            # checked, but allowed alone: bin/bench gives a plain server and a speculating one the same flags
            problem = _steps_by_batch_problem(self.speculative_num_steps_by_batch_size)
            if problem:
                raise ValueError(problem)
            return
        if algo not in ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"):
            raise ValueError(f"bad --speculative-algorithm {algo} (NGRAM, STANDALONE, EAGLE, EAGLE3, NEXTN)")
        head = algo in ("EAGLE", "EAGLE3")
        # a chain of only --speculative-num-draft-tokens N (SGLang's NGRAM command lines) drafts N - 1
        chain_of = self.speculative_num_draft_tokens - 1 if self.speculative_eagle_topk <= 1 else 0
        steps = self.speculative_num_steps or (chain_of if chain_of > 0 else 3)
        tokens = self.speculative_num_draft_tokens or steps + 1
        for ok, problem in (
            (self.speculative_num_draft_tokens == 0 or self.speculative_num_draft_tokens >= 2,
             "--speculative-num-draft-tokens must be >= 2 (a draft and the bonus token; 0: --speculative-num-steps "
             "+ 1)"),
            (1 <= steps <= MAX_SPEC_STEPS, f"--speculative-num-steps must be in 1..{MAX_SPEC_STEPS}"
             if self.speculative_num_steps else  # (derived: an audit read a flag it never gave)
             f"--speculative-num-draft-tokens {tokens} makes a chain of {steps} drafts: at most {MAX_SPEC_STEPS} "
             f"(--speculative-num-draft-tokens at most {MAX_SPEC_STEPS + 1})"),
            (self.speculative_draft_layers >= 0, "--speculative-draft-layers must be >= 0"),  # before what it means
            *_tree_checks(self.speculative_eagle_topk, steps, tokens, self.enable_deterministic_inference),
            (algo == "STANDALONE" or not self.speculative_draft_layers,
             "--speculative-draft-layers N: self-drafts need --speculative-algorithm STANDALONE"),
            (algo == "STANDALONE" or head or not self.speculative_draft_model_path,
             f"--speculative-draft-model-path needs --speculative-algorithm STANDALONE, EAGLE or EAGLE3 (not {algo}: "
             "NGRAM has no draft model, NEXTN drafts with the model's own MTP layer)"),
            (not head or self.speculative_draft_model_path,
             f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the head's directory)"),
            (algo != "STANDALONE" or self.speculative_draft_layers > 0 or self.speculative_draft_model_path,
             "--speculative-algorithm STANDALONE needs --speculative-draft-layers N (a self-draft) or "
             "--speculative-draft-model-path"),
            (not (self.speculative_draft_model_path and self.speculative_draft_layers),
             "--speculative-draft-model-path and --speculative-draft-layers: choose one draft"),
            (0.0 <= self.speculative_corrupt_drafts < 1.0 and (algo == "NGRAM" or not self.speculative_corrupt_drafts),
             "--speculative-corrupt-drafts must be in [0, 1), with --speculative-algorithm NGRAM"),
        ):
            if not ok:
                raise ValueError(problem)
        if self.speculative_draft_model_path:  # absolute, so that every worker finds the same directory
            path = Path(self.speculative_draft_model_path).expanduser()
            if not path.is_dir():
                raise ValueError(f"--speculative-draft-model-path {path}: no such directory")
            object.__setattr__(self, "speculative_draft_model_path", str(path.resolve()))
        problem = (_spec_head_problem(algo, self.model, self.speculative_draft_model_path)
                   or _steps_by_batch_problem(self.speculative_num_steps_by_batch_size))
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "speculative_num_steps", steps)  # frozen; set once here
        object.__setattr__(self, "speculative_num_draft_tokens", tokens)

    def _check_nodes(self) -> None:
        """--nnodes > 1: the Step stream and `done` travel over tcp (msgs/channels.TcpPlan) on
        --dist-init-addr's host, ports PORT+1 (done) and PORT+2+r (steps of rank r)."""
        if self.nnodes == 1:
            return
        hp = _host_port(self.dist_init_addr)
        if hp is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
        from msgs.channels import TcpPlan

        last = TcpPlan.beside_store(*hp).ports(self.world_size)[-1]
        if last > 65535:
            raise ValueError(f"--dist-init-addr port {hp[1]}: the Step/done channels need ports {hp[1] + 1}..{last}, "
                             "past 65535; pick a lower port")
        if self.enable_hierarchical_cache:
            raise ValueError("--enable-hierarchical-cache with --nnodes > 1: the host tier's slab is node-local "
                             "shared memory (one cache controller per engine); use one node")

    def deterministic(self, device_type: str) -> bool:
        """Whether a worker on `device_type` runs deterministic inference: with the flag, and on a
        CPU by default, where it costs nothing measurable in float32 or bf16 (cpu_attention's
        kernel; docs/PERF.md, "Deterministic inference, cost on CPU"), unless
        --disable-deterministic-inference, a non-torch attention backend, draft trees (whose
        attention is not causal: --speculative-eagle-topk > 1) or context parallelism (whose
        invariant attention reads K/V once a row: a GQA model on a CPU takes the flag) are asked for."""
        if self.enable_deterministic_inference:
            return True
        return (device_type == "cpu" and not self.disable_deterministic_inference and self.cp_size == 1
                and self.attention_backend in ("auto", "torch") and self.speculative_eagle_topk <= 1)

    @property
    def constrained_decoding(self) -> bool:
        """Whether structured output is served (--grammar-backend other than none)."""
        return self.grammar_backend != "none"

    @property
    def net(self) -> TcpPlan | None:
        """Where the channels that cross nodes listen (None: one node, every channel ipc)."""
        if self.nnodes == 1:
            return None
        from msgs.channels import TcpPlan

        host, port = _host_port(self.dist_init_addr)  # type: ignore[misc]  # checked in _check_nodes
        return TcpPlan.beside_store(host, port)

    def _check_hicache(self) -> None:
        for ok, problem in (
            (self.hicache_ratio > 0, "--hicache-ratio must be > 0"),
            (self.hicache_size >= 0, "--hicache-size must be >= 0 (GB; 0: use --hicache-ratio)"),
            (self.hicache_write_policy in ("write_through", "write_through_selective", "write_back"),
             f"bad --hicache-write-policy {self.hicache_write_policy} (write_through, write_through_selective)"),
            (self.hicache_write_policy != "write_back",
             "--hicache-write-policy write_back is not implemented yet (write_through, write_through_selective)"),
            # (an audit: --hicache-size and a policy were taken silently without the tier, --l3-dir refused)
            (self.enable_hierarchical_cache
             or (self.hicache_size == 0 and self.hicache_write_policy == "write_through"),
             "--hicache-size and --hicache-write-policy need --enable-hierarchical-cache"),
            (not (self.enable_hierarchical_cache and self.disable_radix_cache),
             "--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)"),
            (not self.l3_dir or self.enable_hierarchical_cache,
             "--l3-dir needs --enable-hierarchical-cache (L3 files are read into and written from the L2 host tier)"),
            (self.l3_size > 0, "--l3-size must be > 0 (GB)"),
        ):
            if not ok:
                raise ValueError(problem)
        if self.l3_dir:  # absolute, so that every process finds the same directory
            path = Path(self.l3_dir).expanduser()
            if path.exists() and not path.is_dir():
                raise ValueError(f"--l3-dir {self.l3_dir}: not a directory")
            object.__setattr__(self, "l3_dir", str(path.resolve()))  # frozen; set once here

    def _check_serving(self) -> None:
        """Parser names against their registries (no parser is imported), and the chat
        template file, made absolute so that every process finds it."""
        for flag, value, table in (
            ("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS),
            ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS),
        ):
            if value and value not in table:
                raise ValueError(f"bad {flag} {value} (known: {', '.join(sorted(table))})")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"bad --grammar-backend {self.grammar_backend} ({' | '.join(GRAMMAR_BACKENDS)})")
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError(f"bad --sampling-defaults {self.sampling_defaults} (model | openai)")
        if self.chat_template:
            path = Path(self.chat_template).expanduser()
            if not path.is_file():
                raise ValueError(f"--chat-template {self.chat_template}: "
                                 + ("a directory, not a file" if path.is_dir() else "no such file"))
            object.__setattr__(self, "chat_template", str(path.resolve()))  # frozen; set once here

    @property
    def world_size(self) -> int:
        """Worker processes: tp x cp (rank = cp_rank * tp_size + tp_rank, engine/run/dist.py)."""
        return self.tp_size * self.cp_size

    @property
    def verify_in_graphs(self) -> bool:
        """Verify steps replay the decode CUDA graphs (engine/run/spec.py: a chain's k + 1 tokens are
        k + 1 decode rows): every draft source's chains. A separate draft model or a head then
        follows the replay eagerly (its KV; a head's hidden states are graph outputs). Trees
        (topk > 1) verify eagerly (the torch backend's masks)."""
        return bool(self.speculative_algorithm) and self.speculative_eagle_topk == 1

    @property
    def speculative_steps_by_batch(self) -> tuple[tuple[int, int], ...]:
        """--speculative-num-steps-by-batch-size as (rows, steps) rules, rows ascending (validated)."""
        return parse_steps_by_batch(self.speculative_num_steps_by_batch_size)

    @property
    def decode_graph_rows(self) -> int:
        """Rows of the largest decode CUDA graph: every running request's verify row (its
        num_draft_tokens) when verify steps replay the graphs, else one row a request."""
        tokens = self.speculative_num_draft_tokens if self.verify_in_graphs else 1
        return self.max_running_requests * tokens

    def batch_wait_s(self, device_type: str) -> float:
        """--batch-wait-ms in seconds for workers on `device_type` (auto: CPU 2 ms, else 0)."""
        if self.batch_wait_ms >= 0:
            return self.batch_wait_ms / 1e3
        return 0.002 if device_type == "cpu" else 0.0

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self) -> range:
        """The global ranks whose workers run on this node (LOCAL_RANK = rank - start)."""
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if not self.model:
            return "SmolLM2-135M-Instruct"
        # "." or "..": the directory's own name (an audit: --model . served the model as "", which no request
        # could name)
        return Path(self.model).name or Path(self.model).resolve().name

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # lazy: the tokenizer process never needs torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def sdk_addr(self) -> str:
        from msgs.channels import sdk_address

        return sdk_address(self.host, self.sdk_port)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        return msgspec.json.decode(text, type=cls)


MAX_TREE_NODES = 64  # --speculative-num-draft-tokens with a tree: the row's first token and 63 drafts at most


def _tree_checks(topk: int, steps: int, tokens: int, deterministic: bool) -> list[tuple[bool, str]]:
    """Draft trees (--speculative-eagle-topk > 1, docs/architecture.md, Speculative decoding,
    Trees): with more nodes than the chain of --speculative-num-steps (which the tree always
    holds), not under deterministic inference (its one attention path is causal)."""
    if topk == 1:
        return [(tokens == steps + 1, f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = "
                 f"{steps + 1} with --speculative-eagle-topk 1 (a chain verifies its drafts and one bonus token)")]
    return [
        (topk >= 1, "--speculative-eagle-topk must be >= 1"),
        (steps + 1 < tokens <= MAX_TREE_NODES,
         f"--speculative-eagle-topk {topk} needs --speculative-num-draft-tokens in {steps + 2}..{MAX_TREE_NODES} "
         f"(the tree's nodes, its first token included: more than the chain of --speculative-num-steps {steps})"),
        (not deterministic,
         f"--speculative-eagle-topk {topk}: draft trees run without --enable-deterministic-inference (its "
         "attention has one causal path)"),
    ]


def parse_steps_by_batch(text: str) -> tuple[tuple[int, int], ...]:
    """"ROWS:STEPS,..." -> ((rows, steps), ...); ValueError (naming no flag) when malformed."""
    rules = []
    for part in text.replace(" ", "").split(","):
        if part:
            rows, sep, steps = part.partition(":")
            if not sep or not (rows + steps).isascii() or not rows.isdigit() or not steps.isdigit():
                raise ValueError(f"{part!r} is not ROWS:STEPS")
            rules.append((int(rows), int(steps)))
    return tuple(rules)


def _steps_by_batch_problem(text: str) -> str | None:
    """What is wrong with --speculative-num-steps-by-batch-size: rules with rows ascending and
    drafts that never grow with the batch (speculation pays less the larger it is)."""
    flag = f"--speculative-num-steps-by-batch-size {text!r}"
    try:
        rules = parse_steps_by_batch(text)
    except ValueError as e:
        return f"{flag}: {e} (a comma-separated list of ROWS:STEPS, e.g. {SPEC_BY_BATCH_DEFAULT})"
    rows, steps = [r for r, _ in rules], [s for _, s in rules]
    if rows != sorted(set(rows)):
        return f"{flag}: ROWS must be strictly ascending"
    if steps != sorted(steps, reverse=True):
        return f"{flag}: STEPS must not grow with ROWS (more decode rows, fewer drafts)"
    if steps and steps[0] > MAX_SPEC_STEPS:  # a cap above any --speculative-num-steps is a typo, not a rule
        return f"{flag}: STEPS must be in 0..{MAX_SPEC_STEPS} (--speculative-num-steps' range)"
    return None


def _spec_head_problem(algo: str, model: str, head: str) -> str | None:
    """What makes a draft head unusable with the model, read from the config.json files where the
    model is a local directory (otherwise the worker checks the same at start, naming the flag)."""
    if algo not in ("EAGLE", "EAGLE3", "NEXTN") or not model or not (Path(model) / "config.json").is_file():
        return None
    target = _read_json(Path(model) / "config.json")
    if algo == "NEXTN":
        arch = (target.get("architectures") or ["?"])[0]
        if arch not in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM") or not target.get("num_nextn_predict_layers"):
            return (f"--speculative-algorithm NEXTN: {model} ({arch}) has no MTP layer (a DeepSeek-V3 config with "
                    "num_nextn_predict_layers >= 1)")
        return None
    if not (Path(head) / "config.json").is_file():
        return f"--speculative-draft-model-path {head}: no config.json"
    cfg = _read_json(Path(head) / "config.json")
    width = cfg.get("target_hidden_size") or cfg.get("hidden_size") if algo == "EAGLE3" else cfg.get("hidden_size")
    if width != target.get("hidden_size"):
        return (f"--speculative-draft-model-path {head}: the {algo} head reads hidden states of {width} values, the "
                f"model's are {target.get('hidden_size')}")
    if cfg.get("vocab_size") != target.get("vocab_size"):
        return (f"--speculative-draft-model-path {head}: the head's vocabulary has {cfg.get('vocab_size')} tokens, "
                f"the model's {target.get('vocab_size')}")
    return None


def _check_deterministic_cp(cfg: ServerConfig, mla: bool) -> None:
    """What --cp-size > 1 does not build under deterministic inference (engine/run/assembly.py
    check_context_parallel, which also checks the kernel compiled): refused here before any process
    starts (an audit: exit 1 from a worker)."""
    if cfg.cp_size <= 1 or not cfg.enable_deterministic_inference:
        return
    flags = f"--cp-size {cfg.cp_size} with --enable-deterministic-inference"
    if mla:
        raise ValueError(f"{flags}: MLA's batch-invariant attention under context parallelism is not built")
    if cfg.resolved_device != "cpu" or cfg.kv_cache_dtype != "auto":
        raise ValueError(f"{flags}: its invariant attention is built on the CPU attention kernel only (a CPU, "
                         "float32 or bf16 KV, the kernel compiled)")


def _check_device(cfg: ServerConfig) -> None:
    """What asks for CUDA on a machine without it (the worker checks the same, after every process
    started: an audit saw exit 1 after 3 s). torch is imported only where a flag names CUDA."""
    if cfg.device != "cuda" and cfg.attention_backend != "flashinfer":
        return
    if cfg.device == "cuda" or cfg.resolved_device != "cuda":
        import torch

        if not torch.cuda.is_available():
            flag = "--device cuda" if cfg.device == "cuda" else "--attention-backend flashinfer"
            raise ValueError(f"{flag}: this torch sees no CUDA device (torch.cuda.is_available() is False)"
                             + ("" if cfg.device == "cuda" else "; use --attention-backend torch (or auto)"))


def check_before_start(cfg: ServerConfig) -> None:
    """What the supervisor checks once the model directory is known (the default model is filled in
    after the flags are parsed), before any process starts; a ValueError names the flag:
    * --tp-size against the model's heads (engine/layers/shards.head_shard, the rule the layers split by),
      and with the host tier, K/V heads that split evenly (its pages are one size on every rank);
    * --l3-dir created (with its parents) and writable, so the cache controller does not fail after ready;
    * STANDALONE drafts: --speculative-draft-layers below the model's layers, a draft model directory with
      a config.json, the model's vocabulary and weights (the worker checks the same, but only after every
      process has started);
    * --chat-template compiles;
    * --cp-size > 1 under deterministic inference: a GQA model, on a CPU, without an fp8 KV cache;
    * --device cuda or --attention-backend flashinfer on a machine without CUDA."""
    from engine.layers.shards import head_shard  # (torch-free)

    model = _read_json(Path(cfg.model) / "config.json")
    heads, kv = model.get("num_attention_heads"), model.get("num_key_value_heads") or model.get("num_attention_heads")
    tp = cfg.tp_size
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0:
        try:
            head_shard(heads, kv, 0, tp)
        except ValueError:
            raise ValueError(f"--tp-size {tp}: the model has {heads} attention heads and {kv} K/V heads; with fewer "
                             "K/V heads than ranks the heads must divide by --tp-size and --tp-size by the K/V heads"
                             ) from None
        mla = model.get("kv_lora_rank") is not None  # one latent a token: the same on every rank
        if cfg.enable_hierarchical_cache and not mla and kv >= tp and kv % tp:
            split = " + ".join(str(head_shard(heads, kv, r, tp).num_kv) for r in range(tp))
            raise ValueError(f"--enable-hierarchical-cache with --tp-size {tp}: the model's {kv} K/V heads split "
                             f"{split} over the ranks, and the host tier needs equal KV pages on every rank (a "
                             f"--tp-size that divides {kv}, or no host tier)")
    _check_standalone_draft(cfg, model)
    _check_deterministic_cp(cfg, mla=model.get("kv_lora_rank") is not None)
    _check_device(cfg)
    if cfg.chat_template:
        from engine.tokenizer import read_chat_template

        read_chat_template(cfg.chat_template)
    if cfg.l3_dir:
        try:
            Path(cfg.l3_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--l3-dir {cfg.l3_dir}: cannot create it ({exc.strerror or exc})") from None
        if not os.access(cfg.l3_dir, os.W_OK | os.X_OK):
            raise ValueError(f"--l3-dir {cfg.l3_dir}: not writable")


def _check_standalone_draft(cfg: ServerConfig, model: dict) -> None:
    """A STANDALONE draft that cannot be built from the model (engine/run/spec.py's rules, before start)."""
    if cfg.speculative_algorithm != "STANDALONE":
        return
    layers = model.get("num_hidden_layers")
    n = cfg.speculative_draft_layers
    if n and isinstance(layers, int) and not 1 <= n < layers:
        raise ValueError(f"--speculative-draft-layers {n}: must be in 1..{layers - 1} (the model has {layers} layers)")
    path = cfg.speculative_draft_model_path
    if not path:
        return
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--speculative-draft-model-path {path}: no config.json (a draft model's directory)")
    vocab, draft_vocab = model.get("vocab_size"), _read_json(Path(path) / "config.json").get("vocab_size")
    if isinstance(vocab, int) and isinstance(draft_vocab, int) and vocab != draft_vocab:
        raise ValueError(f"--speculative-draft-model-path {path}: its vocabulary has {draft_vocab} tokens, the "
                         f"model's {vocab}: a draft must share the tokenizer")
    if cfg.load_format != "dummy" and not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"--speculative-draft-model-path {path}: no safetensors weights there")


def _host_port(addr: str) -> tuple[str, int] | None:
    """("host", port) from "host:port" ([v6]:port too), or None when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def _read_json(path: Path) -> dict:
    """A model's config.json, or a ValueError that names the file."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object expected, found {type(data).__name__}")
    return data
