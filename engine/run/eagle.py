"""Speculative drafts from a head fed the target's hidden states: EAGLE, EAGLE3 (models/eagle.py)
and NEXTN, DeepSeek-V3's MTP layer (models/nextn.py). docs/architecture.md, "Speculative
decoding: EAGLE, EAGLE3, NEXTN".

The head at position p reads (h_p, token p + 1) and predicts token p + 2. Two stores, both
indexed by KV slot through the target's page tables (so trims, frees and prefix-cache hits apply
to them as to the target's KV):
- the hidden pool: h_p for every token the target ran (EAGLE, NEXTN: its final hidden state,
  after its norm; EAGLE3: fc over three of its residual streams), written by `follow`;
- the head's KV pool (its own layers), entry p = the head run on (h_p, token p + 1).
`follow`, after every target forward over tokens s .. s+n-1, writes h_s .. h_{s+n-1}, then runs
the head over entries s-1 .. s+n-2 (their next tokens are this forward's tokens; entry s-1
reads h_{s-1} from the pool). Entry s+n-1 waits for its next token: the next forward of the
request writes it, or the first draft step does. `propose` drafts a verify row [L at p0, -1 x k]
greedily: step 0 runs the head on (h_{p0-1}, L) at entry p0-1, step j on (g, d_j) at p0-1+j,
g the head's own output of step j-1. The draft steps' KV entries past p0-1 are rewritten by
the `follow` of the verify forward with the target's hidden states, so after acceptance the
head's KV holds (h_p, token p + 1) for every accepted token.

The target's hidden states come from forward hooks on its decoder layers, registered only when
this draft exists: a target without speculation runs exactly as before. A decode CUDA graph
(plain decode and chain verify rows replay them) is captured with the hooks on, so what they
compute is one of its outputs (`HiddenTap.captured` / `replayed`); `follow` then runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import ServerConfig
from engine.layers.attention import AttentionBackend, create_backend
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.mla_attention import MLABackend, decode_kernel_available
from engine.layers.parallel import lm_logits
from engine.layers.triton_ops import PreNormed
from engine.run.cuda_graph import CudaGraphRunner
from engine.run.dist import rank_config
from engine.run.spec import chain_drafts
from models.config import ModelConfig
from models.eagle import EagleHead, head_keeps, read_head, tensor_names
from models.loader import init_dummy, load_safetensors
from models.nextn import ARCHS, NextN, nextn_layers

Rows = list[tuple[int, int, int, list[int]]]  # per drafting row: (index of its first token in ids, k, p0, pages)


class HiddenTap:
    """Forward hooks on some of the target's decoder layers: the residual stream after each
    (x + residual, every token of the forward), summed at once because the next layer's fused
    add-norm may reuse x's and residual's storage."""

    def __init__(self, layers: nn.ModuleList, which: list[int]) -> None:
        self.which = which
        self.out: dict[int, torch.Tensor] = {}
        self.graph_out: dict[int, dict[int, torch.Tensor]] = {}  # per captured decode graph: its streams
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(which))]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, residual = output
            # a copy: later layers add into the residual in place
            self.out[i] = residual.clone() if x is None or isinstance(x, PreNormed) else x + residual
        return hook

    def captured(self, bs: int) -> None:
        """The hooks ran inside the capture of the `bs`-row decode graph (engine/run/cuda_graph.py):
        the streams they wrote are that graph's outputs, rewritten by each replay."""
        self.graph_out[bs] = dict(self.out)
        self.out.clear()

    def replayed(self, bs: int, rows: int) -> None:
        """The `bs`-row graph was replayed for its first `rows` rows: their streams, as a forward's."""
        self.out = {i: t[:rows] for i, t in self.graph_out[bs].items()}

    def take(self) -> list[torch.Tensor]:
        """The tapped layers' streams of the last target forward, in `which` order."""
        if any(i not in self.out for i in self.which):
            raise RuntimeError("a draft head follows a target forward that ran without its hidden-state hooks")
        out = [self.out[i] for i in self.which]
        self.out.clear()
        return out


class HeadDraft:
    """A rank's draft head: its module (EagleHead or NextN), KV pool and hidden pool."""

    follows = True  # its KV and hidden pool follow every target forward

    def __init__(self, head: EagleHead | NextN, tap: HiddenTap, feature: Callable[[list[torch.Tensor]], torch.Tensor],
                 kv: KVPool, backend: AttentionBackend | None, hidden_size: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.head, self.tap, self.feature = head, tap, feature
        self.kv, self.backend = kv, backend
        self.page_size, self.device = page_size, device
        self.hidden = torch.zeros(num_pages * page_size, hidden_size, dtype=dtype, device=device)
        self.graphs: CudaGraphRunner | None = None  # the head's decode graphs (capture_graphs), where capturable
        self.step: HeadStep | None = None

    def capture(self, rows: int) -> None:
        """The head's decode CUDA graphs, up to `rows` rows (the target's): its draft steps and
        the rows it follows replay them (a follow's tokens as decode rows, as a verify row's)."""
        self.step = HeadStep(self, rows)
        self.graphs = CudaGraphRunner(self.step, self.kv, self.backend, rows, self.device)
        self.graphs.capture()

    def _run(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.backend is not None:
            self.backend.prepare(batch)
        return self.head(batch.input_ids, hidden, batch, self.kv, self.backend)

    def _replay(self, ids: torch.Tensor | list[int], positions: list[int], tables: list[list[int]],
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over decode rows (token ids[i] at positions[i] through tables[i], reading
        hidden[i]) by a replay of its graphs: (rows for the LM head, the next step's hidden)."""
        assert self.graphs is not None and self.step is not None
        n = len(positions)
        self.step.hidden_in[:n].copy_(hidden)
        dev = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64).to(self.device,
                                                                                               non_blocking=True)
        out = self.graphs.run_decode([0] * n, [0] * n, positions, tables, None, device_ids=dev)
        return out[:, : self.step.width], out[:, self.step.width :]

    def _fits(self, rows: int) -> bool:
        return self.graphs is not None and rows <= self.graphs.max_batch

    @torch.inference_mode()
    def follow(self, batch: ForwardBatch, replayed: bool = False) -> None:
        """After a target forward: its hidden states into the pool, the head's KV entries up to
        the one before each row's last token. After a replay of the target's decode graphs (decode
        or verify rows) the head replays its own, each entry a decode row."""
        self.hidden[batch.out_slots] = self.feature(self.tap.take()).to(self.hidden.dtype)
        shifted = shift(batch)
        if shifted is None:
            return
        hidden = self.hidden[shifted.out_slots]
        if replayed and self._fits(len(shifted.positions)):
            assert shifted.page_table_cpu is not None
            starts, lens = shifted.start_pos_cpu, shifted.extend_lens_cpu
            tables = [shifted.page_table_cpu[i].tolist() for i in range(len(lens))]
            self._replay(shifted.input_ids, [s + j for s, n in zip(starts, lens, strict=True) for j in range(n)],
                         [t for t, n in zip(tables, lens, strict=True) for _ in range(n)], hidden)
        else:
            self._run(shifted, hidden)

    @torch.inference_mode()
    def propose(self, ids: list[int], rows: Rows, alts: int = 1,
                first: torch.Tensor | None = None) -> list[list[list[int]]]:
        """Fill each row's k drafts in `ids` (after its first token; `first`: every row's first
        token on the device, where one is a chained row's future reference), greedily, one head
        step per draft position for all rows at once; each step's drafts feed the next on the
        device, and all are read on the host once, at the end. With alts > 1 (a draft tree's
        leaves, engine/run/spec_tree.py), also each row's `alts` best tokens at every step."""
        module, vocab = self.head.head()
        ps = self.page_size
        g: torch.Tensor | None = None  # the last step's hidden output, the next step's input

        def step(j: int, act: list[int], tokens: torch.Tensor | list[int],
                 keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            nonlocal g
            positions = [rows[r][2] - 1 + j for r in act]
            tables = [rows[r][3] for r in act]
            if keep is None or g is None:  # the target's h at p0 - 1
                slots = [t[p // ps] * ps + p % ps for p, t in zip(positions, tables, strict=True)]
                hidden = self.hidden[torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)]
            else:
                hidden = g[keep]
            if self._fits(len(act)):
                out, g = self._replay(tokens, positions, tables, hidden)  # (views: read before the next replay)
            else:
                batch = ForwardBatch.build(tokens, positions, [1] * len(act), tables, [1] * len(act), ps, self.device)
                out, g = self._run(batch, hidden)
            logits = lm_logits(out, module.weight, vocab, module.packed)
            alt = self.head.to_target(logits.topk(min(alts, logits.shape[-1]), dim=-1).indices) if alts > 1 else None
            return self.head.to_target(logits.argmax(dim=-1)), alt

        return chain_drafts(ids, [r[0] for r in rows], [r[1] for r in rows], first, self.device, step)


class HeadStep(nn.Module):
    """A draft head as a decode-graph model (engine/run/cuda_graph.py): its hidden input read from
    a static buffer (filled before each replay), its two outputs (rows for the LM head, the next
    step's hidden) side by side in one."""

    def __init__(self, draft: HeadDraft, rows: int) -> None:
        super().__init__()
        self.run = draft.head.forward
        self.width = draft.hidden.shape[1]
        self.hidden_in = torch.zeros(rows, self.width, dtype=draft.hidden.dtype, device=draft.device)

    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend | None) -> torch.Tensor:
        out, g = self.run(batch.input_ids, self.hidden_in[: batch.input_ids.shape[0]], batch, kv, backend)
        return torch.cat([out, g], dim=-1)


def shift(batch: ForwardBatch) -> ForwardBatch | None:
    """The head's entries for `batch`: row (s, n) becomes entries s-1 .. s+n-2 whose next tokens
    are the row's tokens (s = 0: entries 0 .. n-2); None when no row has any."""
    assert batch.page_table_cpu is not None
    ps = batch.page_size
    idx: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    tables: list[list[int]] = []
    off = 0
    for i, (s, n) in enumerate(zip(batch.start_pos_cpu, batch.extend_lens_cpu, strict=True)):
        skip = int(s == 0)
        if n > skip:
            idx.extend(range(off + skip, off + n))
            starts.append(s - 1 + skip)
            lens.append(n - skip)
            tables.append(batch.page_table_cpu[i, : math.ceil((s + n - 1) / ps)].tolist())
        off += n
    if not lens:
        return None
    sel = torch.tensor(idx, dtype=torch.int64)
    ids = batch.input_ids[sel if batch.input_ids.device.type == "cpu" else sel.to(batch.input_ids.device)]
    return ForwardBatch.build(ids, starts, lens, tables, [0] * len(lens), ps, batch.input_ids.device)


def make_head_draft(cfg: ServerConfig, model: nn.Module, mcfg: ModelConfig, num_pages: int, max_context: int,
                    dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> HeadDraft:
    """The draft head `--speculative-algorithm` names, loaded and bound to `model` (the target)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(body, "norm") or not hasattr(body, "embed_tokens"):
        raise ValueError(f"--speculative-algorithm {cfg.speculative_algorithm}: {type(model).__name__} exposes no "
                         "decoder layers to read hidden states from")
    embed = body.embed_tokens  # type: ignore[union-attr]
    lm_head = model.lm_head if getattr(model, "lm_head", None) is not None else embed
    final = len(layers) - 1

    def final_hidden(taps: list[torch.Tensor]) -> torch.Tensor:  # EAGLE, NEXTN: after the target's norm
        return body.norm(taps[0])  # type: ignore[union-attr, operator]

    if cfg.speculative_algorithm == "NEXTN":
        head: EagleHead | NextN = load_nextn(cfg, mcfg, dtype, device)
        feature, tap = final_hidden, HiddenTap(layers, [final])
        kv = KVPool.from_layout(type(model).kv_layout(rank_config(mcfg)), 1, num_pages, cfg.page_size,  # type: ignore[attr-defined]
                                kv_dtype, device)
        backend = None  # MLA attends its latent pool itself; on CUDA a backend of its own holds its graph state
        if decode_kernel_available(device):
            backend = MLABackend(device)
            backend.bind(num_q_heads=rank_config(mcfg).num_heads, kv_pool=kv, max_batch=cfg.decode_graph_rows,
                         max_pages_per_req=math.ceil(max_context / cfg.page_size) + 1, q_dtype=dtype)
        hidden = mcfg.hidden_size
    else:
        head, aux = load_eagle(cfg, mcfg, dtype, max_context, device)
        eagle3 = cfg.speculative_algorithm == "EAGLE3"
        feature = head.feature if eagle3 else final_hidden
        tap = HiddenTap(layers, aux if eagle3 else [final])
        shard = rank_config(head.config)
        kv = KVPool.from_layout(KVLayout.gqa(shard.num_kv_heads, shard.head_dim), head.config.num_layers, num_pages,
                                cfg.page_size, kv_dtype, device)
        backend = create_backend("torch", device)
        backend.bind(num_q_heads=shard.num_heads, kv_pool=kv, max_batch=cfg.decode_graph_rows,
                     max_pages_per_req=math.ceil(max_context / cfg.page_size) + 1, q_dtype=dtype)
        hidden = head.config.hidden_size
    head.share(embed, lm_head)
    return HeadDraft(head, tap, feature, kv, backend, hidden, num_pages, cfg.page_size, dtype, device)


def load_eagle(cfg: ServerConfig, target: ModelConfig, dtype: torch.dtype, max_context: int,
               device: torch.device) -> tuple[EagleHead, list[int]]:
    """The EAGLE / EAGLE3 head in --speculative-draft-model-path, checked against the target, and
    (EAGLE3) the target layers whose outputs fc reads."""
    algo, path = cfg.speculative_algorithm, cfg.speculative_draft_model_path
    flag = f"--speculative-draft-model-path {path}"
    try:
        spec = read_head(path, algo)
    except (ValueError, OSError) as e:  # no safetensors (a pytorch_model.bin head), a bad config.json
        raise ValueError(f"{flag}: not an {algo} head in the HF format ({e})") from e
    width = spec.target_hidden if algo == "EAGLE3" else spec.cfg.hidden_size
    problems = [
        (width == target.hidden_size, f"{flag}: the {algo} head reads hidden states of {width} values, the model's "
         f"are {target.hidden_size}"),
        (spec.cfg.vocab_size == target.vocab_size, f"{flag}: the head's vocabulary has {spec.cfg.vocab_size} tokens, "
         f"the model's {target.vocab_size}"),
        (spec.own_head or spec.draft_vocab == target.vocab_size,
         f"{flag}: draft_vocab_size {spec.draft_vocab} but no lm_head in the checkpoint (the model's has "
         f"{target.vocab_size} rows)"),
        ((spec.own_head and spec.own_embed) or spec.cfg.hidden_size == target.hidden_size,
         f"{flag}: a head of hidden size {spec.cfg.hidden_size} needs its own embed_tokens and lm_head (the model's "
         f"are {target.hidden_size} wide)"),
        (algo == "EAGLE" or spec.cfg.num_layers == 1, f"{flag}: EAGLE3 heads of {spec.cfg.num_layers} layers "
         "(only one midlayer is built)"),
        (spec.cfg.quant is None, f"{flag}: quantized heads are not supported"),
        (algo != "EAGLE" or "fc.weight" in spec.names and "layers.0.self_attn.q_proj.weight" in spec.names,
         f"{flag}: not an EAGLE checkpoint (no fc.weight / layers.0.self_attn)"),
        (algo != "EAGLE3" or "fc.weight" in spec.names and "midlayer.self_attn.q_proj.weight" in spec.names,
         f"{flag}: not an EAGLE3 checkpoint (no fc.weight / midlayer.self_attn)"),
    ]
    for ok, problem in problems:
        if not ok:
            raise ValueError(problem)
    n = target.num_layers
    aux = list(spec.aux_layers) if spec.aux_layers else [1, n // 2 - 1, n - 4]  # SGLang: inputs of 2, n/2, n-3
    if algo == "EAGLE3" and (len(aux) != 3 or not all(0 <= i < n for i in aux)):
        raise ValueError(f"{flag}: EAGLE3 reads the outputs of target layers {aux}; the model has {n} layers "
                         "(eagle_config.eagle_aux_hidden_state_layer_ids names three of them)")
    with torch.device(device):
        head = EagleHead(spec, dtype, max_context)
    load_safetensors(head, spec.cfg, path, progress=False, keep=head_keeps(spec))
    return head.eval(), aux


def load_nextn(cfg: ServerConfig, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> NextN:
    """The model's first MTP layer (`model.layers.{num_hidden_layers}`), from its checkpoint
    (random with --load-format dummy)."""
    from models.quant_weights import prepare_model, runtime_form

    flag = "--speculative-algorithm NEXTN"
    if mcfg.architecture not in ARCHS or not nextn_layers(cfg.model):
        raise ValueError(f"{flag}: {mcfg.architecture} in {cfg.model} has no MTP layer (a DeepSeek-V3 config with "
                         "num_nextn_predict_layers >= 1)")
    index = mcfg.num_layers
    prefix = f"model.layers.{index}."
    names: set[str] = set()
    if cfg.load_format != "dummy":
        names = {n for n in tensor_names(cfg.model) if n.startswith(prefix)}
        if prefix + "eh_proj.weight" not in names:
            raise ValueError(f"{flag}: the checkpoint in {cfg.model} lacks the MTP layer's weights ({prefix}*)")
    with torch.device(device):
        mtp = NextN(mcfg, index, dtype, prefix + "embed_tokens.weight" in names,
                    prefix + "shared_head.head.weight" in names)
    if cfg.load_format == "dummy":
        init_dummy(mtp, seed=1)
    else:
        if mcfg.quant is not None:
            prepare_model(mtp, mcfg.quant)
        load_safetensors(mtp, mcfg, cfg.model, progress=False, keep=lambda n: n.startswith(prefix))
    runtime_form(mtp, dtype, device)  # CPU: all plain; CUDA: NVFP4 expert stacks plain
    return mtp.eval()

