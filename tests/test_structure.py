"""The structure facts docs/architecture.md states, read from the source's own imports (ast, nothing is run): no
import circles between modules, no import from a lower wing into the loop, config free of models, rollouts free of
config, the trainer free of concrete engines, no engine-kind branch outside engines/factory.py, a cap on the top
level, the Trainer class under 200 lines, no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "nearpolicy"
BENCH = PACKAGE.parent.parent / "bench"
# the loop (orchestration) and everything above it: what the lower wings may never import
LOOP = ("nearpolicy.training", "nearpolicy.rollouts", "nearpolicy.diagnosis", "nearpolicy.arena", "nearpolicy.runs",
        "nearpolicy.config", "nearpolicy.cli", "nearpolicy.api", "nearpolicy.doctor")
NEVER = {"nearpolicy.ops": LOOP + ("nearpolicy.engines", "nearpolicy.tasks", "nearpolicy.model", "nearpolicy.tools"),
         "nearpolicy.engines": LOOP + ("nearpolicy.model", "nearpolicy.tasks"),
         "nearpolicy.tasks": LOOP + ("nearpolicy.engines", "nearpolicy.model"),
         "nearpolicy.tools": LOOP + ("nearpolicy.engines", "nearpolicy.model", "nearpolicy.tasks"),
         "nearpolicy.model": LOOP + ("nearpolicy.engines.factory",),
         "nearpolicy.rollouts.worker": ("nearpolicy.rollouts.scheduler", "nearpolicy.rollouts.service"),
         # rollouts get plain settings (rollouts/replicas.ReplicaSettings), never the Config
         "nearpolicy.rollouts": ("nearpolicy.training", "nearpolicy.config", "nearpolicy.runs", "nearpolicy.cli",
                                 "nearpolicy.api", "nearpolicy.arena", "nearpolicy.diagnosis"),
         # config validates against the registries below it; it never loads a model
         "nearpolicy.config": ("nearpolicy.model", "nearpolicy.training", "nearpolicy.rollouts", "nearpolicy.runs",
                               "nearpolicy.diagnosis", "nearpolicy.arena", "nearpolicy.cli", "nearpolicy.api"),
         "nearpolicy.runs.folder": ("nearpolicy.training", "nearpolicy.runs.start_checks"),
         "nearpolicy.runs.start_checks": ("nearpolicy.training",),
         "nearpolicy.training.assemble": ("nearpolicy.training.trainer",)}
# the orchestrator speaks the RolloutEngine protocol only; engines are built by engines/factory.py in assemble
TRAINER = ("nearpolicy.training.trainer", "nearpolicy.training.phases", "nearpolicy.training.update")
TOP_LEVEL_CAP = 10  # modules directly in src/nearpolicy besides __init__ and __main__; the rest live in wings


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
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text())
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
               "nearpolicy.engines.llama_adapter", "nearpolicy.engines.roofline", "nearpolicy.types",
               "nearpolicy.signals", "nearpolicy.engines"}
    assert reached <= allowed, sorted(reached - allowed)
    for m in reached:
        path = PACKAGE.parent / (m.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        import sys

        third_party = {t for t in top if t not in sys.stdlib_module_names and t not in ("nearpolicy", "__future__")}
        assert third_party <= {"numpy"}, (m, third_party)


def test_the_trainer_imports_no_concrete_engine():
    bad = [f"{m} imports {d}" for m, deps in _graph().items() if m in TRAINER
           for d in deps if d.startswith("nearpolicy.engines.") and d.split(".")[2] != "base"]
    assert not bad, bad


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= TOP_LEVEL_CAP, top


def _kind_branches(path: Path, kinds: set[str]) -> list[str]:
    """Comparisons against an engine kind's name ("llamacpp" == x, x in ("hf", "vllm"), match cases) and dicts
    keyed by one, in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        values: list = []
        if isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
            values += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set)) for e in v.elts]
        elif isinstance(node, ast.Dict):
            values = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            values = [node.value]
        if any(isinstance(v, ast.Constant) and v.value in kinds for v in values):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_engine_kind_branch_outside_the_factory():
    """Adding an engine kind is one new module plus one entry in engines/factory.py: nothing else in the package or
    the benchmarks compares against a kind's name (what differs between kinds is data in its EngineKind)."""
    from nearpolicy.engines.factory import ENGINES

    kinds = set(ENGINES)
    assert kinds >= {"llamacpp", "hf", "vllm"}
    files = [p for p in [*PACKAGE.rglob("*.py"), *BENCH.rglob("*.py")] if p != PACKAGE / "engines" / "factory.py"]
    bad = [where for p in files for where in _kind_branches(p, kinds)]
    assert not bad, bad


def test_the_kind_branch_counter_sees_a_branch(tmp_path):
    """The counter above finds the branches it forbids (a test that could not fail would prove nothing)."""
    source = tmp_path / "branchy.py"
    source.write_text('if kind == "llamacpp":\n    pass\nx = {"hf": 1}\ny = kind in ("vllm", "x")\nz = "hf"\n')
    lines = [int(w.rsplit(":", 1)[1]) for w in _kind_branches(source, {"llamacpp", "hf", "vllm"})]
    assert sorted(lines) == [1, 3, 4]  # the comparison, the dict key, the membership test; not the plain string


def _wing(module: str) -> str:
    """nearpolicy.runs.folder -> "runs/", nearpolicy.cli -> "cli.py" (how docs/architecture.md names a wing)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] + ("/" if (PACKAGE / parts[1]).is_dir() else ".py")


def _pictured_floors() -> dict[str, int]:
    """Wing -> floor as docs/architecture.md's picture draws it: a line opening with a floor number starts that
    floor; a wing is the `name/` or `name.py` that opens a line at column 4."""
    text = (PACKAGE.parent.parent / "docs" / "architecture.md").read_text()
    block = text.split("```")[1]
    floors, floor = {}, None
    for line in block.splitlines():
        head = line[:4]
        if head.strip().isdigit():
            floor = int(head)
        if floor is None or not line[4:5].strip():
            continue
        token = line[4:].split()[0]
        if token.endswith(("/", ".py")):
            floors[token] = floor
    return floors


def test_the_architecture_picture_matches_the_import_graph():
    """Each wing sits one floor above the highest wing it imports (the bottom floor imports none), as
    docs/architecture.md draws it; every wing of the package is in the picture."""
    graph = _graph()
    deps: dict[str, set[str]] = {}
    for m, ds in graph.items():
        wing = _wing(m)
        deps.setdefault(wing, set())
        deps[wing] |= {_wing(d) for d in ds if d != "nearpolicy" and _wing(d) != wing}
    floor: dict[str, int] = {}

    def height(w: str) -> int:
        if w not in floor:
            floor[w] = 1 + max((height(d) for d in deps[w]), default=0)
        return floor[w]

    measured = {w: height(w) for w in deps if w not in ("__init__.py", "__main__.py")}
    pictured = _pictured_floors()
    assert pictured == measured, {w: (pictured.get(w), measured.get(w)) for w in set(pictured) | set(measured)
                                  if pictured.get(w) != measured.get(w)}
