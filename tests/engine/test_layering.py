"""Imports point one way (docs/architecture.md, "Layers: imports point one way"): procs ->
engine/run -> models -> engine/layers -> msgs. Checked on the source, so a lazy import inside a
function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> module prefixes it must never import
FORBIDDEN = {
    "msgs": ("torch", "engine", "models", "procs"),
    "engine/layers": ("models", "engine.run", "engine.sched", "engine.serve", "engine.cache", "engine.replica",
                      "engine.config", "engine.local", "engine.supervise", "engine.tokenizer", "engine.bench",
                      "engine.analyze", "procs"),
    "models": ("engine.run", "engine.sched", "engine.serve", "procs"),
    "engine/replica": ("torch", "engine.cache", "engine.run", "engine.sched", "engine.serve", "models", "procs"),
    "engine/sched": ("torch", "engine.run", "engine.serve", "models", "procs"),
    "engine/cache": ("torch", "engine.run", "engine.sched", "engine.serve", "models", "procs"),
    "engine/serve": ("torch", "engine.run", "engine.sched", "models", "procs"),
    # the worker never imports the front end (tokenizer loading lives below both: engine/tokenizer.py)
    "engine/run": ("engine.serve", "engine.sched", "procs"),
    # read by every process: the config and the tables it checks names against
    "engine/config.py": ("engine.serve", "engine.run", "engine.sched", "engine.cache", "models", "procs"),
    "engine/parser_names.py": ("torch", "engine", "models", "procs"),
    # the bottom of engine/: read by every layer (an audit found these unchecked)
    "engine/env.py": ("torch", "engine", "models", "procs", "msgs"),
    "engine/hub.py": ("torch", "engine", "models", "procs"),
    "engine/tokenizer.py": ("torch", "engine", "models", "procs"),
    "engine/logs.py": ("torch", "engine.run", "engine.sched", "engine.serve", "engine.layers", "models", "procs"),
    # the supervisor's helpers start processes; they never load a model or run a step
    "engine/supervise.py": ("torch", "engine.run", "engine.sched", "engine.serve", "engine.layers", "models",
                            "procs"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_downward(package: str) -> None:
    bad = []
    root = ROOT / package
    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
