"""The package's import graph, read with ``ast``: every import counts, at the top of a module, inside a function
(lazy) or under ``if TYPE_CHECKING:`` (type-only). A cycle a lazy or type-only import hides is still a cycle: the
modules cannot be read, tested or moved one without the other.

The floors, from the top: cli -> release -> workflows -> the libraries (engines, runtime, quantize, convert,
acceptance, ggml, gguf_io, tensors, ...). Arrows run downward only."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtpq"

# the floors above the libraries, top first; every other subpackage of mtpq is a library
UPPER = ("cli", "release", "workflows")


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph(package: Path = PACKAGE, type_only: bool = True) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the file) and the top-level packages it imports;
    ``type_only=False`` leaves out the imports under ``if TYPE_CHECKING:``."""
    mods = _modules(package)
    root = package.name
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_only else _type_checking_only(tree)
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                if t.split(".")[0] != root:
                    deps.add(t.split(".")[0])  # an outside package: torch, numpy, ...
                    continue
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int:
    """A module's floor: 0 for the libraries, then workflows, release, cli (``python -m mtpq``: above all)."""
    parts = module.split(".")
    if parts[1:2] == ["__main__"]:
        return len(UPPER) + 1
    sub = parts[1] if len(parts) > 1 else ""
    return len(UPPER) - UPPER.index(sub) if sub in UPPER else 0


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows from a floor to a floor above it."""
    return sorted(
        (m, d) for m, deps in graph.items() for d in deps if d in graph and d != "mtpq" and floor(d) > floor(m)
    )


def test_no_import_cycle_lazy_and_type_only_imports_included():
    assert cycles(import_graph()) == []


def test_arrows_run_downward():
    """No library imports workflows, release or cli; workflows import neither release nor cli; release does not
    import cli."""
    assert upward(import_graph()) == []


def test_the_floors_exist():
    graph = import_graph()
    assert {floor(m) for m in graph} == {0, 1, 2, 3, 4}
    assert "mtpq.cli" in graph["mtpq.__main__"]


def test_the_model_libraries_stand_apart():
    """convert (checkpoint -> plan), quantize (plan -> plan with types) and runtime (GGUF -> torch model) import
    none of each other: a job that needs two of them is a workflow."""
    graph = import_graph()
    parts = ("convert", "quantize", "runtime")
    crossing = sorted(
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if m.split(".")[1:2]
        and d.split(".")[1:2]
        and m.split(".")[1] in parts
        and d.split(".")[1] in parts
        and m.split(".")[1] != d.split(".")[1]
    )
    assert crossing == []


def test_the_walk_sees_lazy_and_type_only_imports(tmp_path):
    """The checks can fail. The convert circle this test was written against, in miniature: ``base`` imports
    ``validate``, which calls back into ``base``'s family under ``if TYPE_CHECKING:``; ``checkpoint`` imports
    ``validate`` for one check, which names ``checkpoint`` for its types. Only a walk that counts type-only
    imports sees it; a lazy import from a library up to the cli is an arrow up."""
    pkg = tmp_path / "pkg"
    (pkg / "convert").mkdir(parents=True)
    (pkg / "cli").mkdir()
    files = {
        "__init__.py": "",
        "convert/__init__.py": "from .base import Family\n",
        "convert/base.py": "from . import validate\nfrom .checkpoint import Ckpt\nclass Family: ...\n",
        "convert/checkpoint.py": "from .validate import check_config\nclass Ckpt: ...\n",
        "convert/validate.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .base import Family\n"
            "    from .checkpoint import Ckpt\ndef check_config(c): ...\n"
        ),
        "convert/stream.py": "def f():\n    from ..cli import app\n",
        "cli/__init__.py": "app = None\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert cycles(import_graph(pkg)) == [["pkg.convert.base", "pkg.convert.checkpoint", "pkg.convert.validate"]]
    assert cycles(import_graph(pkg, type_only=False)) == []
    assert upward(import_graph(pkg)) == [("pkg.convert.stream", "pkg.cli")]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_private_name_is_imported():
    """A name with a leading underscore is its module's own: no other module imports it (what several modules
    need is public, and defined once)."""
    found = []
    for name, path in _modules(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "mtpq"):
                found += [
                    f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert found == []


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def unresolved_test_imports(tests: Path, others: tuple[Path, ...] = ()) -> list[str]:
    """Every ``from tests.x import y`` in the test tree, lazy ones inside a test included, whose module or name
    does not exist (a lazy import of a renamed module fails only when its -- maybe llama.cpp-marked -- test runs),
    and every private name one test module takes from another; ``others``: more files that import the tests'
    helpers (the benchmarks)."""
    mods = _modules(tests)
    bad = []
    for path in [*mods.values(), *others]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == tests.name):
                continue
            where = f"{path.relative_to(tests.parent) if path.is_relative_to(tests.parent) else path}:{node.lineno}"
            if node.module not in mods:
                bad.append(f"{where}: no module {node.module}")
                continue
            defined = _top_level_names(mods[node.module])
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    continue  # a submodule
                if a.name not in defined:
                    bad.append(f"{where}: {node.module} has no {a.name}")
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{where}: {node.module}.{a.name} is private")
    return bad


def test_every_test_import_resolves():
    root = PACKAGE.parent
    assert unresolved_test_imports(root / "tests", tuple(sorted((root / "benchmarks").glob("*.py")))) == []


def test_the_test_import_check_can_fail(tmp_path):
    tests = tmp_path / "tests"
    (tests / "helpers").mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "helpers" / "__init__.py").write_text("")
    (tests / "helpers" / "a.py").write_text("X = 1\ndef f(): ...\ndef _g(): ...\n")
    (tests / "test_b.py").write_text(
        "from tests.helpers.a import X, f\n"
        "def test():\n    from tests.helpers.a import _g, h\n    from tests.runtime.gone import f\n"
    )
    assert unresolved_test_imports(tests) == [
        "tests/test_b.py:3: tests.helpers.a._g is private",
        "tests/test_b.py:3: tests.helpers.a has no h",
        "tests/test_b.py:4: no module tests.runtime.gone",
    ]
