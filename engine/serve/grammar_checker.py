"""The grammar checker: a child process of the tokenizer process that compiles a request's
grammar with xgrammar, so that engine/serve/grammar.py can refuse what does not compile,
takes too long or is too large before any rank gets it.

A process, not a thread: a compile past the time limit is killed. In a thread it could not
be stopped: an audit's 300 union-typed properties compiled for minutes after their 400,
holding one of the pool's two threads, so that two such requests made every other
constrained request time out. xgrammar (and torch, which it imports) stay out of the
tokenizer process.

Frames on the child's stdin / stdout: a 4-byte little-endian length, then msgpack (never a
pickle). The child's first frame is `CheckReady`; then one `CheckReply` per `CheckRequest`.
It exits at the end of its stdin.

    python -m engine.serve.grammar_checker MODEL_DIR VOCAB_SIZE
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import msgspec

from msgs.frames import read_frame, write_frame

COMPILE_THREADS = 2  # xgrammar's threads inside one compile
START_TIMEOUT_S = 120.0  # importing xgrammar and torch, and the tokenizer info: seconds on 2 cores


class CheckReady(msgspec.Struct, tag=True):
    stop_ids: list[int]  # the TokenizerInfo's stop tokens


class CheckRequest(msgspec.Struct, tag=True):
    text: str  # a structural tag's JSON


class CheckReply(msgspec.Struct, tag=True):
    source: str  # what every rank compiles (engine/serve/grammar.py `compilable`)
    compiled_bytes: int  # CompiledGrammar.memory_size_bytes
    seconds: float
    error: str = ""  # xgrammar's message: the grammar does not compile


class CheckerStartError(RuntimeError):
    """The child did not start (no tokenizer files, xgrammar missing, past START_TIMEOUT_S)."""


class Checker:
    """One child process, used by one thread at a time; started on first use, and again after
    a kill or a death."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_ids: list[int] = []
        self._dec = msgspec.msgpack.Decoder(CheckReady | CheckReply)

    def check(self, text: str, timeout_s: float) -> CheckReply:
        """Compile `text` in the child. TimeoutError after timeout_s (the child killed);
        ChildProcessError if the child died meanwhile (whatever killed it: the next call starts
        another); CheckerStartError if it could not start."""
        self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            write_frame(self.proc.stdin.fileno(), msgspec.msgpack.encode(CheckRequest(text)))
        except OSError as exc:
            self.kill()
            raise ChildProcessError(f"the grammar checker is gone ({exc})") from None
        reply = self._reply(timeout_s)
        assert isinstance(reply, CheckReply)
        return reply

    def start(self) -> None:
        """Start the child and take its ready frame, unless it runs (CheckerStartError)."""
        if self.proc is not None:
            return
        cmd = [sys.executable, "-m", "engine.serve.grammar_checker", self.model_dir, str(self.vocab_size)]
        try:
            # a process group of its own: a terminal's Ctrl-C stops the server through its supervisor, and
            # must not interrupt a checker mid-import (a traceback on the console); it exits with its stdin
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0)
        except OSError as exc:  # out of processes or file descriptors
            raise CheckerStartError(f"the grammar checker did not start: {exc}") from None
        try:
            ready = self._reply(START_TIMEOUT_S)
        except TimeoutError:
            raise CheckerStartError(f"the grammar checker did not start in {START_TIMEOUT_S:g} s") from None
        except ChildProcessError as exc:
            raise CheckerStartError(f"the grammar checker did not start: {exc}") from None
        assert isinstance(ready, CheckReady)
        self.stop_ids = ready.stop_ids

    def _reply(self, timeout_s: float) -> CheckReady | CheckReply:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        poll = select.poll()  # not select(): this process may hold more than 1,024 fds (connections)
        poll.register(fd, select.POLLIN)
        if not poll.poll(timeout_s * 1000):  # nothing yet: the whole frame follows at once
            self.kill()
            raise TimeoutError
        frame = read_frame(fd)
        if frame is None:
            code = self.proc.wait()
            self.kill()  # its pipes closed
            raise ChildProcessError(f"the grammar checker exited (code {code})")
        return self._dec.decode(frame)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None


NOTHING_MATCHES = "it matches no text (no token can begin an answer)"


def can_begin(compiled: object, vocab_size: int) -> bool:
    """Whether some token (an end token included) can begin text the compiled grammar matches: a
    grammar that compiles but matches nothing (`root ::= root`, an empty character class) would
    give a request nothing to sample, every logit masked."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return bool(mask.any())


def main() -> None:
    from engine.serve.grammar import compilable, first_line
    from engine.tokenizer import grammar_compiler, load_tokenizer, tokenizer_info

    model_dir, vocab_size = sys.argv[1], int(sys.argv[2])
    tok = load_tokenizer(model_dir)
    if tok is None:
        sys.exit(f"grammar checker: {model_dir!r} has no tokenizer files")
    info = tokenizer_info(tok.hf, vocab_size)
    compiler = grammar_compiler(info, COMPILE_THREADS)
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # frames only on the pipe
    dec = msgspec.msgpack.Decoder(CheckRequest)
    write_frame(wfd, msgspec.msgpack.encode(CheckReady([int(t) for t in info.stop_token_ids])))
    while (frame := read_frame(rfd)) is not None:
        text = dec.decode(frame).text
        t0 = time.perf_counter()
        try:
            source = compilable(text)
            compiled = compiler.compile_structural_tag(source)
            reply = CheckReply(source, compiled.memory_size_bytes, time.perf_counter() - t0,
                               "" if can_begin(compiled, info.vocab_size) else NOTHING_MATCHES)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors: a grammar it cannot compile
            reply = CheckReply("", 0, time.perf_counter() - t0, first_line(exc))
        write_frame(wfd, msgspec.msgpack.encode(reply))
    os._exit(0)  # xgrammar's threads: nothing to flush


if __name__ == "__main__":
    main()
