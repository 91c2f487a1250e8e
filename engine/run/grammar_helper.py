"""Grammar helper processes: a rank's xgrammar matchers spread over a few processes.

Why: xgrammar's accept_token and fill_next_token_bitmask hold the GIL, and a step's accepts
are serial: 64 rows of the structured benchmark took 2.2-3.0 ms of one H200 host core a
step, longer than the GPU's whole step (2.8 ms), so the worker's host thread, not the GPU,
set the pace (59% of unconstrained throughput). Each helper owns the matchers of the slots
`slot % n == its index`, so the rows of a step are accepted and filled on n cores at once,
while the worker's thread waits on pipes without the GIL.

Protocol: a helper's first frame says it is ready (xgrammar imported, tokenizer info built);
then length-prefixed msgspec frames over the helper's stdin / stdout (never pickle).
Matchers are named by an id the worker assigns on AddReq (a slot is reused by later
requests; an accept for an id already freed is ignored and touches no bitmask row). The
bitmask, by slot, is one anonymous shared-memory file (memfd) mapped by the worker and every
helper (passed as an inherited fd: nothing to clean up after a kill -9). A helper fills a
row only for a live matcher of its own.

Speculative verify rows (HDraft): the memfd holds, past the slots' rows, a region of
MAX_DRAFTS x max_slots rows (sparse: its pages exist once written); the mask of a verify
row's drafted position j (1..k: the matcher's state after drafts d1..dj) goes to row
(j - 1) * max_slots + slot of that region. The helper accepts the drafts one at a time,
fills each position's row, stops at a draft the grammar refuses (the position before it,
already filled, masks it out; the positions past it are never reached) or at a stop token,
then rolls the matcher back: it advances only by the answered tokens (HAccept, in order,
one fill after a slot's last). The region starts on a page boundary, so a CUDA worker
registers it apart from the slots' rows.

Requests and replies on one pipe are in order; the
worker holds a helper's lock from a request to its reply, except for HAdd: a step's new
matchers are sent to their helpers without waiting (64 new requests cost 64 round trips of
~0.8 ms each, serially, inside one step), and their replies are taken before the next reply
on that pipe or by `settle()`, which the worker calls before it reads the bitmask. A helper
exits when its stdin closes (the worker is gone); a helper that dies makes the worker's next
call raise.

`python -m engine.run.grammar_helper MODEL_DIR VOCAB_SIZE MAX_SLOTS BITMASK_FD NOTICE_FD` runs one.
"""

from __future__ import annotations

import mmap
import os
import select
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from msgs.frames import read_frame, write_frame

MAX_DRAFTS = 16  # drafted positions a verify row may have: ServerConfig's bound on --speculative-num-steps


class HAdd(msgspec.Struct, tag=True):
    id: int
    slot: int
    key: str  # a grammar sent before (HPrepare)
    output_ids: list[int]  # a retracted request's tokens so far


class HPrepare(msgspec.Struct, tag=True):
    """Compile a grammar on the helper's compile thread and keep it until HForget (no reply; the
    compile thread writes HPrepared to the notice pipe when done): sent to every helper when
    PrepareGrammar brings a key into the rank's GrammarKeys, so that they compile at once, in
    parallel, while their main thread goes on accepting and filling rows; its data crosses each
    pipe once, not with every request."""

    key: str
    data: bytes  # the grammar's source, zlib-compressed (msgs.params.Grammar.data)
    generation: int  # GrammarKeys.prepared after it: HPrepared names it


class HForget(msgspec.Struct, tag=True):
    """Drop a grammar (no reply): it left the rank's GrammarKeys. Its live matchers keep it."""

    key: str


class HFree(msgspec.Struct, tag=True):
    id: int


class HAccept(msgspec.Struct, tag=True):
    rows: list[tuple[int, int, int]]  # (id, slot, token): accept, then fill the slot's row if live


class HFill(msgspec.Struct, tag=True):
    rows: list[tuple[int, int]]  # (id, slot)


class HDraft(msgspec.Struct, tag=True):
    """A verify step's drafts: fill the masks of each row's drafted positions, roll back."""

    rows: list[tuple[int, int, list[int]]]  # (id, slot, drafts d1..dk)


class HDone(msgspec.Struct, tag=True):
    rows: list[tuple[int, bool, bool]]  # (id, accepted, terminated), one per request row


class HDrafted(msgspec.Struct, tag=True):
    rows: list[tuple[int, int]]  # (id, drafted positions filled: 1..f), one per HDraft row


class HPrepared(msgspec.Struct, tag=True):
    """On the notice pipe, not a reply: an HPrepare's compile finished."""

    key: str
    generation: int
    error: str = ""  # "" when it compiled


class HError(msgspec.Struct, tag=True):
    reason: str


Request = HAdd | HPrepare | HForget | HFree | HAccept | HFill | HDraft
Reply = HDone | HDrafted | HError


_LEAD_FOLLOWERS = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def utf8_guard(info: Any) -> Any:
    """An int32 bitmask row (xgrammar's layout, the TokenizerInfo's vocabulary) that clears the
    tokens which would make the output ill-formed UTF-8 whatever follows: bytes C0, C1, F5-FF;
    a lead byte E0/ED/F0/F4 followed in the token by a byte outside its range (an overlong form,
    a surrogate, past U+10FFFF), or ending the token (the next token's first byte would be
    unchecked: xgrammar's byte automaton takes any continuation there). ANDed into every
    grammar row: xgrammar 0.2.9 admits those forms in strings, and each decodes to U+FFFD per
    byte. What it costs: U+0800-U+0FFF, U+D000-U+D7FF and planes 1-16 only through tokens that
    hold their lead byte and the next one (byte-level vocabularies merge these)."""
    import numpy as np
    import torch

    row = np.full(-(-info.vocab_size // 32), 0xFFFFFFFF, dtype=np.uint32)  # xgrammar's words: bit t%32 of t//32
    for t, b in enumerate(info.decoded_vocab):
        for i, c in enumerate(b):
            span = _LEAD_FOLLOWERS.get(c)
            if c in (0xC0, 0xC1) or c >= 0xF5 or (span and (i + 1 == len(b) or not span[0] <= b[i + 1] <= span[1])):
                row[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
                break
    return torch.from_numpy(row.view(np.int32))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> Any:
    """xgrammar's allocate_token_bitmask (int32 [rows, words], every token allowed) without
    importing xgrammar."""
    import torch

    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


class LazyXgrammar:
    """The xgrammar module, imported on first use: a worker imports it (and through it
    transformers: ~1.4 s of its start on 2 cores) only once a grammar reaches it, as the
    tokenizer process does (engine/serve/grammar.py); with helpers it never does."""

    def __getattr__(self, name: str) -> Any:
        import xgrammar

        value = getattr(xgrammar, name)
        setattr(self, name, value)  # found in the instance from now on
        return value


xgr = LazyXgrammar()


def layout(vocab_size: int, max_slots: int) -> tuple[int, int]:
    """The byte offset of the drafted positions' region in the memfd (page-aligned), and the memfd's size."""
    row = bitmask_words(vocab_size) * 4
    start = -(-max_slots * row // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, start + MAX_DRAFTS * max_slots * row


def _table(mapping: mmap.mmap, vocab_size: int, max_slots: int) -> tuple[Any, Any]:
    """The slots' rows [max_slots, words] and the drafted positions' [MAX_DRAFTS * max_slots, words]."""
    import torch

    words, (start, _) = bitmask_words(vocab_size), layout(vocab_size, max_slots)
    slots = torch.frombuffer(mapping, dtype=torch.int32, count=max_slots * words).view(max_slots, words)
    drafted = torch.frombuffer(mapping, dtype=torch.int32, count=MAX_DRAFTS * max_slots * words, offset=start)
    return slots, drafted.view(MAX_DRAFTS * max_slots, words)


# ---- the worker's side --------------------------------------------------------------------


class GrammarHelpers:
    """n helper processes and the shared bitmask (`bitmask`: int32 [max_slots, words], by slot;
    `drafted`: a verify row's drafted position j of a slot at row (j - 1) * max_slots + slot)."""

    def __init__(self, n: int, model_dir: str, vocab_size: int, max_slots: int) -> None:
        self.n = n
        self.max_slots = max_slots
        nbytes = layout(vocab_size, max_slots)[1]  # sparse: the drafted rows cost memory once written
        fd = os.memfd_create("strata-grammar-bitmask")
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.bitmask, self.drafted = _table(self._map, vocab_size, max_slots)
            cmd = [sys.executable, "-m", "engine.run.grammar_helper", model_dir, str(vocab_size), str(max_slots),
                   str(fd)]
            notices = [os.pipe() for _ in range(n)]  # each helper's compile thread -> HPrepared
            try:
                self.procs = [subprocess.Popen([*cmd, str(w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               pass_fds=(fd, w)) for _, w in notices]
            finally:
                for _, w in notices:
                    os.close(w)
        finally:
            os.close(fd)
        self._notices = {r: h for h, (r, _) in enumerate(notices)}
        self._poller = select.poll()
        for r in self._notices:
            self._poller.register(r, select.POLLIN)
        self._notice_dec = msgspec.msgpack.Decoder(HPrepared)
        self.locks = [threading.Lock() for _ in range(n)]
        self.ready = [False] * n  # each helper's ready frame taken
        self.unsettled: list[deque[int]] = [deque() for _ in range(n)]  # HAdd ids whose reply is not read
        self._settled: dict[int, tuple[bool, bool]] = {}  # id -> (accepted, terminated), read, not taken
        self._settled_lock = threading.Lock()
        self._prepares: dict[tuple[str, int], list[Any]] = {}  # (key, generation) -> [helpers done, an error]
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)

    def wait_ready(self) -> None:
        """Wait for every helper's first frame (sent once it has imported xgrammar and built
        the tokenizer info): the worker says ready only after its helpers are."""
        for h in range(self.n):
            with self.locks[h]:
                self._ensure_ready(h)

    def _ensure_ready(self, h: int) -> None:
        """Take helper h's ready frame if not taken yet (under its lock)."""
        if not self.ready[h]:
            self._reply(h)
            self.ready[h] = True

    def owner(self, slot: int) -> int:
        return slot % self.n

    def _send(self, h: int, msg: Request) -> None:
        self._ensure_ready(h)
        stdin = self.procs[h].stdin
        assert stdin is not None
        try:
            write_frame(stdin.fileno(), self._enc.encode(msg))
        except OSError as exc:
            raise RuntimeError(f"grammar helper {h} is gone ({exc}); exit code {self.procs[h].poll()}") from exc

    def _reply(self, h: int) -> Any:
        stdout = self.procs[h].stdout
        assert stdout is not None
        frame = read_frame(stdout.fileno())
        if frame is None:
            raise RuntimeError(f"grammar helper {h} died (exit code {self.procs[h].wait()})")
        reply = self._dec.decode(frame)
        if isinstance(reply, HError):
            raise RuntimeError(f"grammar helper {h}: {reply.reason}")
        return reply

    def prepare(self, key: str, data: bytes, generation: int) -> None:
        """Every helper compiles this grammar now, in parallel, and keeps it until `forget`;
        `prepared` says when all of them did."""
        for k in [k for k in self._prepares if k[0] == key]:  # prepared again: the earlier one is void
            del self._prepares[k]
        self._prepares[key, generation] = [0, ""]
        for h in range(self.n):
            with self.locks[h]:
                self._send(h, HPrepare(key, data, generation))

    def prepared(self) -> list[tuple[str, int, str]]:
        """(key, generation, error: the first helper's, "" when every one compiled it) of the
        prepares that the last of the helpers finished since the last call. Reads only the notice
        pipes that have something (one poll() call): no round trip, no helper's lock."""
        done = []
        while ready := self._poller.poll(0):
            for fd, _ in ready:
                frame = read_frame(fd)  # one whole frame: written at once, shorter than PIPE_BUF
                if frame is None:
                    h = self._notices[fd]
                    raise RuntimeError(f"grammar helper {h} died (exit code {self.procs[h].wait()})")
                notice = self._notice_dec.decode(frame)
                count = self._prepares.get((notice.key, notice.generation))
                if count is None:  # forgotten meanwhile
                    continue
                count[0] += 1
                count[1] = count[1] or notice.error
                if count[0] == self.n:
                    del self._prepares[notice.key, notice.generation]
                    done.append((notice.key, notice.generation, count[1]))
        return done

    def forget(self, key: str) -> None:
        for k in [k for k in self._prepares if k[0] == key]:  # its notices are ignored from now on
            del self._prepares[k]
        for h in range(self.n):
            with self.locks[h]:
                self._send(h, HForget(key))

    def add(self, id: int, slot: int, key: str, output_ids: list[int]) -> None:
        """Create the matcher of a prepared grammar (re-advanced over output_ids) and fill its
        row, without waiting: `settle()` says whether it accepted every output id and whether
        it is terminated."""
        h = self.owner(slot)
        with self.locks[h]:
            self._send(h, HAdd(id, slot, key, output_ids))
            self.unsettled[h].append(id)

    def _drain(self, h: int) -> None:
        """Read helper h's outstanding HAdd replies (under its lock): they come before any later one."""
        while self.unsettled[h]:
            (id, ok, terminated), = self._reply(h).rows
            self.unsettled[h].popleft()
            with self._settled_lock:
                self._settled[id] = (ok, terminated)

    def settle(self) -> dict[int, tuple[bool, bool]]:
        """Wait for every HAdd sent so far (their rows are filled then); id -> (accepted every
        output id, terminated) for those not returned by an earlier call."""
        for h in range(self.n):
            if self.unsettled[h]:
                with self.locks[h]:
                    self._drain(h)
        with self._settled_lock:
            out, self._settled = self._settled, {}
        return out

    def free(self, id: int, slot: int) -> None:
        h = self.owner(slot)
        with self.locks[h]:
            self._send(h, HFree(id))

    def _scatter(self, rows: list[Any], make: Any) -> list[tuple[int, bool, bool]]:
        """Send each helper its rows (all first, then wait: they work at once); the replies
        in the order of `rows`. Locks are taken in helper order (the other thread takes one)."""
        by_helper: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_helper.setdefault(self.owner(row[1]), []).append(i)
        out: list[Any] = [None] * len(rows)
        held = []
        try:
            for h in sorted(by_helper):
                self.locks[h].acquire()
                held.append(h)
                self._send(h, make([rows[i] for i in by_helper[h]]))
            for h in sorted(by_helper):
                self._drain(h)
                for i, res in zip(by_helper[h], self._reply(h).rows, strict=True):
                    out[i] = res
        finally:
            for h in held:
                self.locks[h].release()
        return out

    def accept(self, rows: list[tuple[int, int, int]]) -> list[tuple[int, bool, bool]]:
        """(id, slot, token) rows: accepted and terminated per row; live rows' masks filled."""
        return self._scatter(rows, HAccept)

    def fill(self, rows: list[tuple[int, int]]) -> None:
        self._scatter(rows, HFill)

    def draft(self, rows: list[tuple[int, int, list[int]]]) -> list[int]:
        """(id, slot, drafts) rows: each row's drafted positions filled (1..f, in `drafted`), the
        matchers rolled back. A freed or terminated matcher fills none."""
        if any(len(d) > MAX_DRAFTS for _, _, d in rows):
            raise ValueError(f"a verify row with more than {MAX_DRAFTS} drafts")
        return [filled for _, filled in self._scatter(rows, HDraft)]

    def close(self) -> None:
        for r in self._notices:
            self._poller.unregister(r)
            os.close(r)
        self._notices = {}
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()  # the helper sees the end of its stream and exits
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- the helper process -------------------------------------------------------------------


def serve(model_dir: str, vocab_size: int, max_slots: int, bitmask_fd: int, rfd: int, wfd: int, notice_fd: int) -> None:
    import xgrammar as xgr

    from engine.tokenizer import compile_grammar, grammar_compiler, load_tokenizer, tokenizer_info

    mapping = mmap.mmap(bitmask_fd, layout(vocab_size, max_slots)[1], mmap.MAP_SHARED)
    bitmask, drafted = _table(mapping, vocab_size, max_slots)
    tok = load_tokenizer(model_dir)
    info = tokenizer_info(tok.hf, vocab_size) if tok is not None else None
    guard = utf8_guard(info) if info is not None else None  # as engine/run/grammar.py _fill
    compiler = grammar_compiler(info, 1) if info is not None else None  # one thread: the helpers run side by side
    compiling = ThreadPoolExecutor(1, thread_name_prefix="compile")  # xgrammar compiles without the GIL
    compiled: dict[str, tuple[int, Future[Any]]] = {}  # key -> (generation, its compile), HPrepare to HForget
    notice_enc, notice_lock = msgspec.msgpack.Encoder(), threading.Lock()
    matchers: dict[int, tuple[Any, int]] = {}  # id -> (matcher, slot)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Request)
    write_frame(wfd, enc.encode(HDone([])))  # ready (GrammarHelpers.wait_ready)

    def prepare(data: bytes) -> Any:
        if info is None:
            raise RuntimeError(f"{model_dir!r} has no tokenizer files")
        return compile_grammar(compiler, data)

    def notify(key: str, generation: int, job: Future[Any]) -> None:
        """On the compile thread (or this one, if already done): HPrepared to the notice pipe."""
        if job.cancelled():  # forgotten before it started
            return
        exc = job.exception()
        error = "" if exc is None else f"{type(exc).__name__}: {exc}"[:1000]  # a frame under PIPE_BUF
        with notice_lock:
            write_frame(notice_fd, notice_enc.encode(HPrepared(key, generation, error)))

    def grammar_of(key: str) -> Any:
        entry = compiled.get(key)
        if entry is None:
            raise RuntimeError(f"grammar {key[:12]} was never prepared, or was forgotten")
        return entry[1].result()  # done: the worker adds only after every helper reported it

    def step(m: Any, slot: int) -> bool:
        done = m.is_terminated()
        if not done:
            m.fill_next_token_bitmask(bitmask, slot)
            bitmask[slot] &= guard
        return done

    def draft(id: int, slot: int, tokens: list[int]) -> int:
        """Drafted position j's mask (after d1..dj) in row (j - 1) * max_slots + slot, up to a
        refused draft or a stop token; rolled back. The positions filled (as GrammarSlots._mask_drafted)."""
        entry = matchers.get(id)
        if entry is None or entry[0].is_terminated():
            return 0
        m, taken, filled = entry[0], 0, 0
        for j, tok in enumerate(tokens, 1):
            if not m.accept_token(tok):
                break
            taken = j
            if m.is_terminated():
                break
            row = (j - 1) * max_slots + slot
            m.fill_next_token_bitmask(drafted, row)
            drafted[row] &= guard
            filled = j
        if taken:
            m.rollback(taken)
        return filled

    while (frame := read_frame(rfd)) is not None:
        msg = dec.decode(frame)
        try:
            match msg:
                case HFree(id=id):
                    matchers.pop(id, None)
                    continue
                case HPrepare(key=key, data=data, generation=generation):
                    if key in compiled:  # prepared again: the earlier compile is void
                        compiled[key][1].cancel()
                    job = compiling.submit(prepare, data)
                    compiled[key] = (generation, job)
                    job.add_done_callback(lambda job, key=key, generation=generation: notify(key, generation, job))
                    continue
                case HForget(key=key):
                    entry = compiled.pop(key, None)
                    if entry is not None:
                        entry[1].cancel()  # not started yet: it would hold up the next compiles
                    continue
                case HAdd():
                    m = xgr.GrammarMatcher(grammar_of(msg.key))
                    ok = all(m.accept_token(int(t)) for t in msg.output_ids)
                    matchers[msg.id] = (m, msg.slot)
                    reply: Reply = HDone([(msg.id, ok, step(m, msg.slot))])
                case HAccept(rows=rows):
                    res = []
                    for n, (id, slot, token) in enumerate(rows):
                        entry = matchers.get(id)
                        if entry is None:  # freed meanwhile: its row may be another request's now
                            res.append((id, True, True))
                            continue
                        m = entry[0]
                        # a verify step's answer may go past a stop token (the request ends there)
                        ok = m.is_terminated() or m.accept_token(token)
                        last = n + 1 == len(rows) or rows[n + 1][0] != id  # its answered tokens: one fill
                        res.append((id, ok, step(m, slot) if last else m.is_terminated()))
                    reply = HDone(res)
                case HDraft(rows=rows):
                    if any(len(tokens) > MAX_DRAFTS for _, _, tokens in rows):
                        raise ValueError(f"a verify row with more than {MAX_DRAFTS} drafts")
                    reply = HDrafted([(id, draft(id, slot, tokens)) for id, slot, tokens in rows])
                case HFill(rows=rows):
                    res = []
                    for id, slot in rows:
                        entry = matchers.get(id)
                        res.append((id, True, True if entry is None else step(entry[0], slot)))
                    reply = HDone(res)
        except Exception as exc:  # noqa: BLE001 - reported to the worker, which fails loudly
            reply = HError(f"{type(exc).__name__}: {exc}")
        write_frame(wfd, enc.encode(reply))


def main() -> None:
    model_dir = sys.argv[1]
    vocab, slots, fd, notice = (int(a) for a in sys.argv[2:6])
    wfd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the reply stream
    serve(model_dir, vocab, slots, fd, 0, wfd, notice)


if __name__ == "__main__":
    main()
