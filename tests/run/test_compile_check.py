"""scripts/compile_check.py: triton kernels compiled for an H200 on this machine (no GPU), in a fresh
process (a test file before may have imported the kernels under triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
if not (Path(pytest.importorskip("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").is_file():
    pytest.skip("triton without its nvidia tools", allow_module_level=True)


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_served_kernels_compile_for_the_h200() -> None:
    """Qwen3-30B-A3B's batch-1 decode attention and one-token expert GEMVs: each launch compiles
    for sm_90 and reports its registers (a kernel the compiler refuses fails here, as on the GPU)."""
    r = _run("scripts/compile_check.py", "decode-a3b", "moe-a3b")
    assert r.returncode == 0, r.stderr[-2000:]
    kernels = [line.split()[1] for line in r.stdout.splitlines()]
    assert kernels == ["decode_attention_kernel", "experts13_kernel", "experts2_kernel"], r.stdout
    assert all(0 < int(line.split()[3]) <= 255 for line in r.stdout.splitlines()), r.stdout


def test_a_kernel_the_compiler_refuses_fails(tmp_path: Path) -> None:
    """A kernel reading a module global that is not a tl.constexpr runs in triton's interpreter (so
    the CPU tests pass it) and is refused here; its constexpr twin compiles."""
    (tmp_path / "kernels.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        LIMIT = 7
        LIMIT_C = tl.constexpr(7)

        @triton.jit
        def bad(x, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(x + o, tl.minimum(o, LIMIT), mask=o < n)

        @triton.jit
        def good(x, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(x + o, tl.minimum(o, LIMIT_C), mask=o < n)
    """))
    (tmp_path / "driver.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from scripts import compile_check as cc
        import torch
        import kernels
        for fn in (kernels.good, kernels.bad):
            with cc.recorded() as launches:
                fn[(1,)](torch.zeros(16, dtype=torch.int32), 16, BLOCK=16)
            try:
                cc.compile_launch(*launches[0])
                print(fn.__name__, "compiled")
            except Exception as e:
                print(fn.__name__, "refused", type(e).__name__)
    """))
    r = _run("driver.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["good compiled", "bad refused CompilationError"], r.stdout + r.stderr[-1000:]
    interpreted = subprocess.run(
        [sys.executable, "-c", "import torch, kernels; x = torch.zeros(16, dtype=torch.int32); "
         "kernels.bad[(1,)](x, 16, BLOCK=16); print(x.tolist())"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert interpreted.stdout.strip() == str([min(i, 7) for i in range(16)]), interpreted.stderr[-1000:]
