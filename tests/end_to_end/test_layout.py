"""The package's shape beyond its import graph (tests/test_import_graph.py): the layers that must not need torch
do not import it, and ggml stands alone."""

from __future__ import annotations

from tests.test_import_graph import import_graph


def test_llama_cpp_measurements_and_reports_do_not_need_torch(tmp_path):
    """llama-perplexity's and llama-server's engines, the binary lookup and the quality and acceptance reports
    load, find a split set's shard 1 and format reports without importing torch (a process that never imports it:
    where torch is not installed)."""
    import subprocess
    import sys

    from tests.helpers.ggufcheck import one_tensor_gguf

    model = one_tensor_gguf(tmp_path / "m.gguf")
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
