"""The package's shape: no import cycle in mtpq/ (lazy imports inside functions count too: a cycle a lazy import
hides is still a cycle), and the layers that must not need torch do not import it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mtpq"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the mtpq modules it imports (anywhere in the file) and the top-level packages it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
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
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                if t.split(".")[0] != "mtpq":
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


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_walk_sees_lazy_imports_and_cycles():
    """The check can fail: a lazy import back is found, and a two-module loop is a cycle."""
    graph = import_graph()
    assert "mtpq.runtime.families" in graph["mtpq.runtime.speculative"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_llama_cpp_measurements_and_reports_do_not_need_torch(tmp_path):
    """llama-perplexity's and llama-server's engines, the binary lookup and the quality and acceptance reports
    load, find a split set's shard 1 and format reports without importing torch (a process that never imports it:
    where torch is not installed)."""
    import subprocess
    import sys

    import gguf
    import numpy as np

    model = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code = (
        "import sys\n"
        "from mtpq.engines import binaries, perplexity\n"
        "from mtpq.acceptance.quality import Gates, judge, to_markdown\n"
        "from mtpq.gguf_io.files import first_shard\n"
        f"assert first_shard({str(model)!r}).name == 'm.gguf'\n"
        "f = {'file': 'q.gguf', 'kld_mean': 0.1, 'top1': 0.9}\n"
        "assert judge([f], Gates(max_kld=0.05)) == {'q.gguf': ['mean KLD 0.100000 above 0.05']}\n"
        "report = {'reference': {'file': 'r.gguf'}, 'files': [f], 'chunks': 1, 'ctx_size': 8,\n"
        "          'engine': {'trunk': 'llama.cpp', 'head': 'llama.cpp'}}\n"
        "assert '| `q.gguf` |' in to_markdown(report)\n"
        "from mtpq.engines.llama_cpp import PER_POSITION_NOTE, measure_with_llama_cpp\n"
        "from mtpq.acceptance.metrics import DraftTotals, GenerationResult, metrics_from_totals\n"
        "from mtpq.acceptance.prompts import load_prompts\n"
        "from mtpq.acceptance.report import AcceptReport, PromptRun, judge as judge_acceptance\n"
        "from mtpq.acceptance.report import to_markdown as acceptance_markdown\n"
        "pairs = load_prompts('builtin', 2)\n"
        "tots = [DraftTotals(generated=9, drafted=8, accepted=6, seconds=1.0, k=1) for _ in pairs]\n"
        "runs = [PromptRun(c, t, GenerationResult(prompt_len=3, tokens=list(range(9)), k=1), None) for c, t in pairs]\n"
        "acc = AcceptReport(model='q.gguf', draft=1, temperature=0.0, max_new_tokens=9, runs=runs,\n"
        "                   overall=metrics_from_totals(tots), by_category={pairs[0][0]: metrics_from_totals(tots)},\n"
        "                   plain_tokens_per_s=None, greedy_outputs_identical=None, device='llama.cpp',\n"
        "                   engine='llama.cpp', extra={'note': PER_POSITION_NOTE})\n"
        "assert acc.to_dict()['acceptance_rate'] == 0.75 and acc.overall.per_position == [0.75]\n"
        "assert judge_acceptance(acc, None, min_rate=0.8, max_drop=None).passed is False\n"
        "assert 'engine llama.cpp' in acceptance_markdown(acc)\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:3]\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_ggml_formats_stand_alone():
    """mtpq.ggml is ggml's formats alone: it imports nothing else from mtpq (the quantize policy, the converters
    and the runtime import it, never the reverse)."""
    graph = import_graph()
    ggml = {m for m in graph if m == "mtpq.ggml" or m.startswith("mtpq.ggml.")}
    assert len(ggml) >= 10
    outside = {m: sorted(d for d in graph[m] if d.startswith("mtpq") and d not in ggml) for m in ggml}
    assert {m: d for m, d in outside.items() if d} == {}


def test_only_the_cli_imports_the_cli():
    """mtpq/cli is the top layer: the library (the release runner included) never imports it; only the entry point
    ``python -m mtpq`` does."""
    graph = import_graph()
    cli = {m for m in graph if m == "mtpq.cli" or m.startswith("mtpq.cli.")}
    assert len(cli) >= 10 and "mtpq.cli" in graph["mtpq.__main__"]
    users = {m: sorted(d for d in deps if d in cli) for m, deps in graph.items() if m not in cli and m != "mtpq.__main__"}
    assert {m: d for m, d in users.items() if d} == {}
