"""The structure facts docs/architecture.md states, read from the source's own imports (ast, nothing is run): no
import circles between modules, no upward import from the engines, the math or the task layer into the loop, the
Trainer class under 200 lines, no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "nearpolicy"
# what a layer may never import: the loop (orchestration) and anything above it
LOOP = ("nearpolicy.trainer", "nearpolicy.training_run", "nearpolicy.setup", "nearpolicy.phases",
        "nearpolicy.rollouts", "nearpolicy.cli", "nearpolicy.ray_trainer", "nearpolicy.diagnosis", "nearpolicy.update",
        "nearpolicy.runs", "nearpolicy.resume", "nearpolicy.config")
NEVER = {"nearpolicy.ops": LOOP + ("nearpolicy.engines", "nearpolicy.tasks", "nearpolicy.models"),
         "nearpolicy.engines": LOOP, "nearpolicy.tasks": LOOP + ("nearpolicy.engines",),
         "nearpolicy.rollouts.worker": ("nearpolicy.rollouts.scheduler", "nearpolicy.rollouts.service"),
         "nearpolicy.rollouts": ("nearpolicy.trainer", "nearpolicy.training_run", "nearpolicy.cli", "nearpolicy.ray_trainer"),
         "nearpolicy.runs": ("nearpolicy.trainer", "nearpolicy.setup", "nearpolicy.resume"),
         "nearpolicy.resume": ("nearpolicy.trainer", "nearpolicy.setup"), "nearpolicy.setup": ("nearpolicy.trainer",)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every nearpolicy module `path` imports, at module level or inside functions (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nearpolicy")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nearpolicy"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from nearpolicy.ops import losses`
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_there_are_no_import_circles():
    graph = _graph()
    graph = {m: {d for d in deps if not m.startswith(d + ".") and d != "nearpolicy"} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("layer", sorted(NEVER))
def test_lower_layers_never_import_the_loop(layer):
    bad = [f"{m} imports {d}" for m, deps in _graph().items() if m == layer or m.startswith(layer + ".")
           for d in deps if any(d == n or d.startswith(n + ".") for n in NEVER[layer])]
    assert not bad, bad


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_the_trainer_class_is_under_200_lines_and_no_function_over_80():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 < 200
    long = [f"{p.relative_to(PACKAGE)}:{f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in PACKAGE.rglob("*.py") for f in _functions(ast.parse(p.read_text()))
            if f.end_lineno - f.lineno + 1 > 80]
    assert not long, long


def test_every_source_file_is_under_400_lines():
    assert not [p.name for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) >= 400]


def test_the_vllm_child_imports_only_what_the_vllm_environment_has():
    """engines/vllm_child.py runs under .venv-vllm/bin/python, where nearpolicy's own dependencies (pydantic,
    transformers 5.24, the loop) are not installed: every nearpolicy module it reaches, transitively, is an
    engine-side one, and no module it reaches imports a third-party package at module level other than numpy."""
    graph = _graph()
    reached, todo = set(), ["nearpolicy.engines.vllm_child"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += [d for d in graph[m] if d != "nearpolicy"]
    allowed = {"nearpolicy.engines.vllm_child", "nearpolicy.engines.process", "nearpolicy.engines.llamacpp",
               "nearpolicy.engines.base", "nearpolicy.engines.sampling", "nearpolicy.engines.cpu_load",
               "nearpolicy.engines.kv_reuse", "nearpolicy.engines.llama_context", "nearpolicy.engines.llama_lib",
               "nearpolicy.types", "nearpolicy.signals",
               "nearpolicy.engines"}
    assert reached <= allowed, sorted(reached - allowed)
    for m in reached:
        path = PACKAGE.parent / (m.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        import sys

        third_party = {t for t in top if t not in sys.stdlib_module_names and t not in ("nearpolicy", "__future__")}
        assert third_party <= {"numpy"}, (m, third_party)
