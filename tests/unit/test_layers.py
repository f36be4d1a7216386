"""The layers of docs/architecture.md, checked: which package may import which, no import
cycle, and what must import without the ML stack (peers that only speak the protocol, and the
coordinator's service, journal and verifier, which handle every push, need no torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = ("protocols", "tasks", "engines", "echo_node", "echo_coordinator")
# What each layer may import of ours; it may import anything below it in this table.
MAY_IMPORT = {
    "protocols": {"protocols"},
    "tasks": {"tasks", "protocols"},
    "engines": {"engines", "tasks", "protocols"},
    "echo_node": {"echo_node", "engines", "tasks", "protocols"},
    "echo_coordinator": {"echo_coordinator", "engines", "tasks", "protocols"},
}
HEAVY = ("torch", "transformers", "hivemind", "llama_cpp", "peft")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules `name` imports, at module level or inside functions alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_each_layer_imports_only_those_below_it():
    wrong = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
                   if b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]])
    assert wrong == []


def test_there_is_no_import_cycle():
    """Between modules (a package's __init__ importing its own modules does not count)."""
    graph = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            pytest.fail(" -> ".join(cycle))


def test_the_checks_see_what_they_check():
    # Guards the tests above against passing vacuously (a parser that finds no imports).
    assert "engines.episodes" in GRAPH["echo_coordinator.local_eval"]  # a module-level import
    assert "engines.llama_process" in set().union(*(GRAPH[m] for m in GRAPH if m.startswith("echo_node")))  # a lazy one


def loaded_heavy(*names: str) -> list[str]:
    code = (f"import sys, importlib\nfor m in {list(names)!r}: importlib.import_module(m)\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return [m for m in out.stdout.strip().split(",") if m]


def test_every_protocols_module_imports_without_the_ml_stack():
    pure = sorted(m for m in modules() if m.startswith("protocols") and not m.startswith("protocols.transport"))
    assert len(pure) > 10
    assert loaded_heavy(*pure) == []


def test_the_service_journal_and_verifier_import_without_torch():
    light = sorted(m for m in modules() if m.startswith(("echo_coordinator.service", "echo_coordinator.trainer.samples")))
    light += ["echo_coordinator.journal", "echo_coordinator.verify", "echo_coordinator.ledger", "engines.episodes"]
    assert [m for m in loaded_heavy(*light) if m != "hivemind"] == []


def test_the_check_itself_sees_heavy_modules():
    assert loaded_heavy("torch") == ["torch"]
