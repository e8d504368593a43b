"""`mtpq accept --engine llama.cpp`: llama-server as the acceptance engine.

The default run drives a stand-in llama-server (a small stdlib HTTP script written below, which
answers /health and /completion the way llama-server does and draws its draft counters from a
rule the tests know) to check the server's life (arguments, readiness, failure reason from its
log, no process left after success, errors, SIGTERM or SIGKILL of mtpq) and the report built
from the counters. Tests marked ``llama_cpp`` run the real llama-server: acceptance within 3
points of the torch engine on the bundled demo models, and the same numbers through two
``rpc-server`` processes as without them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

from tests.helpers.ggufcheck import one_tensor_gguf
from tests.helpers.llama_server import llama_server_cmd
from tests.helpers.llamacpp_ref import free_port
from tests.helpers.runcli import run_cli

FAKE_SERVER = r"""
import json, os, socketserver, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
state = os.environ.get("FAKE_STATE_DIR")
if state:
    open(os.path.join(state, "pid"), "w").write(str(os.getpid()))
    open(os.path.join(state, "argv.json"), "w").write(json.dumps(args))
print("main: loading model", flush=True)
if "FAIL" in os.path.basename(opt("-m")):
    print("llama_model_load: error loading model: tensor 'blk.0.attn_q.weight' data is not within the file bounds",
          flush=True)
    print("main: exiting due to model loading error", flush=True)
    sys.exit(1)
t0 = time.monotonic()
k = int(opt("--spec-draft-n-max"))

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        ready = time.monotonic() - t0 > 0.3
        self.send(200 if ready else 503, {"status": "ok" if ready else "loading model"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.environ.get("FAKE_SLOW"):
            time.sleep(60)
        n = req["n_predict"]
        drafted = k * (n // (k + 1))  # the rule the tests recompute: rounds of k drafts,
        accepted = len(req["prompt"]) % (drafted + 1)  # some of them accepted
        t = {"prompt_n": 10, "prompt_ms": 5.0, "predicted_n": n, "predicted_ms": 50.0}
        if not os.environ.get("FAKE_NO_DRAFT"):
            t.update(draft_n=drafted, draft_n_accepted=accepted)
        self.send(200, {"content": "x" * n, "tokens": list(range(n)), "timings": t})

class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

host = opt("--host")
if host.endswith(".sock"):  # llama-server's rule: such a host is a unix socket path
    UnixHTTPServer(host, H).serve_forever()
ThreadingHTTPServer((host, int(opt("--port"))), H).serve_forever()
"""


@pytest.fixture
def fake_bin(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    exe.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("FAKE_STATE_DIR", str(state))
    return d


@pytest.fixture
def model(tmp_path) -> Path:
    return one_tensor_gguf(tmp_path / "m.gguf", "glm4moe")  # mtpq checks a model before it starts llama-server


def _gone(pid: int, wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _pid(fake_bin: Path) -> int:
    return int((fake_bin.parent / "state" / "pid").read_text())


def accept_with_llama_cpp(model, *args):
    """``mtpq accept MODEL --engine llama.cpp ARGS...``."""
    return run_cli("accept", model, "--engine", "llama.cpp", *args)


def accept_at_server(model, url: str, out: Path):
    """k=1 over two prompts through the llama-server at ``url``, the report written to ``out``."""
    return accept_with_llama_cpp(model, "--server", url, "-k", "1", "--max-prompts", "2", "--json", out)


def test_report_from_server_counters(fake_bin, model, tmp_path):
    from mtpq.acceptance.prompts import load_prompts

    out = tmp_path / "r.json"
    res = accept_with_llama_cpp(
        model,
        "--llama-cpp",
        fake_bin,
        "--prompts",
        "builtin",
        "--max-prompts",
        "5",
        "-k",
        "2",
        "-n",
        "30",
        "--json",
        out,
        "--ngl",
        "7",
        "--",
        "--tensor-split",
        "1,1",
    )
    assert res.exit_code == 0, res.output
    argv = json.loads((fake_bin.parent / "state" / "argv.json").read_text())
    for flag, value in (
        ("--spec-type", "draft-mtp"),
        ("--spec-draft-n-max", "2"),
        ("-ngl", "7"),
        ("--tensor-split", "1,1"),
        ("-m", str(model)),
    ):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert _gone(_pid(fake_bin)), "llama-server left running"
    # a unix socket in a folder only we can enter, not a TCP port: a port picked free and bound later by the
    # server can be taken by another server started at the same moment, and we would read its counters
    sock = Path(argv[argv.index("--host") + 1])
    assert sock.name.endswith(".sock") and "--port" not in argv, argv
    assert not sock.parent.exists(), "the socket's folder was left behind"
    doc = json.loads(out.read_text())
    assert doc["server"] == f"unix:{sock}"
    prompts = [p for _, p in load_prompts("builtin", 5)]
    drafted = [2 * (30 // 3)] * 5
    accepted = [len(p) % (d + 1) for p, d in zip(prompts, drafted)]
    assert doc["engine"] == "llama.cpp" and doc["prompts"] == 5
    assert doc["drafted"] == sum(drafted) and doc["accepted"] == sum(accepted)
    assert doc["acceptance_rate"] == pytest.approx(sum(accepted) / sum(drafted))
    assert doc["drafts"] == sum(30 - 1 - a for a in accepted)  # rounds, counted from the tokens
    assert doc["per_position"] == []  # k > 1: llama-server does not say which position failed
    assert doc["tokens_per_s"] == pytest.approx(5 * 30 / (5 * 0.055))


def test_k1_gives_the_position_rate(fake_bin, model, tmp_path):
    out = tmp_path / "r.json"
    res = accept_with_llama_cpp(
        model, "--llama-cpp", fake_bin, "--max-prompts", "3", "-k", "1", "-n", "20", "--json", out
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["per_position"] == [pytest.approx(doc["acceptance_rate"])]
    assert doc["drafts"] == doc["drafted"]  # one token a round


def test_server_that_cannot_load_the_model(fake_bin, tmp_path):
    bad = one_tensor_gguf(tmp_path / "FAIL.gguf", "glm4moe")  # the fake server fails to load it (its name says so)
    res = accept_with_llama_cpp(bad, "--llama-cpp", fake_bin, "--max-prompts", "1")
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "data is not within the file bounds" in line, line
    log = Path(line.split("log: ")[1].rstrip(")"))
    assert log.is_file() and "error loading model" in log.read_text()
    assert _gone(_pid(fake_bin))
    log.unlink()


def test_a_server_that_does_not_draft_is_refused(fake_bin, model, monkeypatch):
    monkeypatch.setenv("FAKE_NO_DRAFT", "1")
    res = accept_with_llama_cpp(model, "--llama-cpp", fake_bin, "--max-prompts", "1")
    assert res.exit_code == 2 and "drafted nothing" in res.stderr, res.output
    assert _gone(_pid(fake_bin))


def test_running_server_by_url(fake_bin, model, tmp_path):
    from mtpq.engines.llama_cpp import LlamaServer, ServerConfig

    with LlamaServer(ServerConfig(fake_bin / "llama-server"), model, draft=1) as srv:
        assert srv.socket_dir.stat().st_mode & 0o777 == 0o700  # no other user can reach or replace the socket
        out = tmp_path / "r.json"
        res = accept_at_server(model, srv.url, out)
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["server"] == srv.url
        pid = srv.proc.pid
    assert _gone(pid)


@pytest.mark.parametrize(
    "args, where",
    [
        (["--ngl", "5"], "--ngl"),  # a llama.cpp option with the torch engine
        (["--engine", "llama.cpp", "--device", "cpu"], "--device"),
        (["--engine", "llama.cpp", "--dtype", "bf16"], "--dtype"),
        (["--engine", "llama.cpp", "--rounds", "llama-speculative-simple"], "--rounds"),
        (["--engine", "llama.cpp", "--server", "gpu-box:8080"], "--server"),
        (["--engine", "llama.cpp", "--server", "http://x:1", "--ngl", "3"], "--ngl"),
        (["--engine", "vllm"], "--engine"),
        (["--engine", "llama.cpp", "--llama-cpp", "/nonexistent"], "--llama-cpp"),
    ],
)
def test_engine_options_are_checked(model, args, where):
    res = run_cli("accept", model, *args)
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {where}"), res.output


def test_running_server_by_tcp_url(fake_bin, model, tmp_path):
    """--server http://HOST:PORT: a server someone started on a TCP port."""
    port = free_port()
    srv = subprocess.Popen(llama_server_cmd(fake_bin, model, port, "--spec-draft-n-max", "1"))
    try:
        from mtpq.engines.llama_cpp import _health

        deadline = time.monotonic() + 30
        while not _health(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            time.sleep(0.1)
        out = tmp_path / "r.json"
        res = accept_at_server(model, f"http://127.0.0.1:{port}", out)
        assert res.exit_code == 0, res.output
        doc = json.loads(out.read_text())
        assert doc["server"] == f"http://127.0.0.1:{port}" and doc["drafted"] > 0, doc
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_no_server_outlives_mtpq(fake_bin, model, monkeypatch, sig, code):
    """mtpq stopped while the server is busy: the server goes too (SIGKILL: it dies with its parent)."""
    monkeypatch.setenv("FAKE_SLOW", "1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # SIGINT as a terminal's Ctrl-C delivers it: a shell that starts a job in the background (`make test &`)
    # leaves SIGINT ignored in it, and Python keeps an inherited SIG_IGN; that child would run on to exit 0
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mtpq.cli",
            "accept",
            str(model),
            "--engine",
            "llama.cpp",
            "--llama-cpp",
            str(fake_bin),
            "--max-prompts",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pidfile = fake_bin.parent / "state" / "pid"
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pidfile.exists(), p.communicate(timeout=5)
    time.sleep(1.5)  # the server is ready and busy with the first request
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert _gone(_pid(fake_bin)), "llama-server outlived mtpq"


BUILD_RECIPE = """
[model]
name = "tiny"
source = "{source}"
output = "dist"
reference_type = "f16"

[gate]
draft = 1
max_new_tokens = 20
max_prompts = 3
min_rate = 0.0
{engine}

[[variant]]
name = "Q8_0"
preset = "Q8_0"
"""


def test_build_gate_on_llama_cpp(glm_ckpt, fake_bin, tmp_path):
    """[gate] engine = "llama.cpp": every GGUF is measured by a llama-server of its own; the manifest says so."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        BUILD_RECIPE.format(
            source=glm_ckpt,
            engine=f'engine = "llama.cpp"\nllama_cpp = "{fake_bin}"\nngl = 0\nserver_args = ["--mlock"]',
        )
    )
    res = run_cli("build", recipe)
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "dist" / "manifest.json").read_text())
    assert manifest["gate"]["engine"] == "llama.cpp" and manifest["gate"]["server_args"] == ["--mlock"]
    gated = [f for f in manifest["files"] if "acceptance" in f]
    assert len(gated) == 2  # the reference and the variant
    for f in gated:
        a = f["acceptance"]
        assert a["engine"] == "llama.cpp" and a["drafted"] == 3 * 10  # the stand-in's rule: k * (n // (k + 1))
    argv = json.loads((fake_bin.parent / "state" / "argv.json").read_text())
    assert "--mlock" in argv and argv[argv.index("-ngl") + 1] == "0"
    assert _gone(_pid(fake_bin))


@pytest.mark.parametrize(
    "engine, key",
    [
        ('engine = "vllm"', "gate.engine"),
        ("ngl = 3", "gate.ngl"),  # a llama.cpp key with the torch engine
        ('engine = "llama.cpp"\nserver_args = [1]', "gate.server_args[0]"),
        ('engine = "llama.cpp"\nctx_size = 0', "gate.ctx_size"),
    ],
)
def test_broken_engine_keys_name_the_key(glm_ckpt, tmp_path, engine, key):
    recipe = tmp_path / "r.toml"
    recipe.write_text(BUILD_RECIPE.format(source=glm_ckpt, engine=engine))
    res = run_cli("build", recipe)
    assert res.exit_code == 2 and key in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output


# ----------------------------------------------------------------------------- the real llama-server

DEMOS = {"glm4moe": ("data/demo", "demo_heldout"), "qwen35": ("data/demo_qwen35", "demo_qwen35_heldout")}
EXACT = ["--", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--no-repack"]  # greedy-exact on tiny models


def _accept_json(*args) -> dict:
    """mtpq accept ARGS --json -; llama-server's own arguments (after `--`) stay last."""
    cut = args.index("--") if "--" in args else len(args)
    res = run_cli("accept", *args[:cut], "--json", "-", *args[cut:])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_engines_agree_on_the_demo_models(demo, llama_cpp_bin, tmp_path):
    """Greedy k=1 acceptance of llama-server's MTP drafting within 1 point of the torch runtime's (both feed the
    head as llama.cpp's draft-mtp driver does; the counts differ where the two stop generating differently)."""
    folder, prompts = DEMOS[demo]
    gguf = tmp_path / f"{demo}.gguf"
    assert (
        run_cli(
            "convert", Path(str(resources.files("mtpq").joinpath(folder))), gguf, "--outtype", "f32", "-q"
        ).exit_code
        == 0
    )
    common = [gguf, "--prompts", prompts, "-k", "1", "-n", "64", "--max-prompts", "12"]
    torch_doc = _accept_json(*common)
    llama_doc = _accept_json(*common, "--engine", "llama.cpp", "--llama-cpp", llama_cpp_bin, "--threads", "1", *EXACT)
    assert llama_doc["drafted"] > 200
    print(
        f"\n{demo}: llama.cpp {llama_doc['accepted']}/{llama_doc['drafted']} = {llama_doc['acceptance_rate']:.2%}, "
        f"torch {torch_doc['accepted']}/{torch_doc['drafted']} = {torch_doc['acceptance_rate']:.2%}"
    )
    assert abs(llama_doc["acceptance_rate"] - torch_doc["acceptance_rate"]) < 0.01, (llama_doc, torch_doc)


@pytest.mark.llama_cpp
def test_acceptance_through_rpc_servers_equals_local(llama_cpp_bin, tmp_path):
    """The model spread over two rpc-server processes on 127.0.0.1: the same greedy numbers as one process."""
    rpc_bin = llama_cpp_bin / "ggml-rpc-server"
    if not rpc_bin.exists():
        rpc_bin = llama_cpp_bin / "rpc-server"
    if not rpc_bin.exists():
        pytest.skip("llama.cpp built without -DGGML_RPC=ON (no rpc-server)")

    gguf = tmp_path / "demo.gguf"
    assert (
        run_cli(
            "convert", Path(str(resources.files("mtpq").joinpath("data/demo"))), gguf, "--outtype", "f32", "-q"
        ).exit_code
        == 0
    )
    ports = [free_port(), free_port()]
    servers = [
        subprocess.Popen(
            [str(rpc_bin), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for port in ports
    ]
    try:
        time.sleep(2)
        assert all(s.poll() is None for s in servers), "rpc-server did not start"
        common = [
            gguf,
            "--engine",
            "llama.cpp",
            "--llama-cpp",
            llama_cpp_bin,
            "--prompts",
            "demo_heldout",
            "-k",
            "1",
            "-n",
            "48",
            "--max-prompts",
            "6",
            "--threads",
            "1",
        ]
        local = _accept_json(*common, *EXACT)
        spread = _accept_json(*common, "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "--ngl", "999", *EXACT)
    finally:
        for s in servers:
            os.killpg(s.pid, signal.SIGTERM)
            s.wait(timeout=10)
    assert spread["drafted"] > 100
    assert (spread["drafted"], spread["accepted"]) == (local["drafted"], local["accepted"])


def test_llama_cpp_children_get_the_users_omp_wait_policy(monkeypatch):
    """mtpq sets OMP_WAIT_POLICY=PASSIVE for its own torch (and one OpenBLAS thread for its numpy); llama.cpp
    children must not inherit them (under PASSIVE llama.cpp exits before its log thread writes the closing
    lines), but a user's own settings pass."""
    from mtpq.engines.llama_cpp import child_env

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MTPQ_SET_ENV", "OMP_WAIT_POLICY,OPENBLAS_NUM_THREADS")
    env = child_env()
    assert not {"OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS", "MTPQ_SET_ENV"} & set(env)
    monkeypatch.delenv("MTPQ_SET_ENV")
    assert child_env()["OMP_WAIT_POLICY"] == "PASSIVE" and child_env()["OPENBLAS_NUM_THREADS"] == "1"


def test_the_cli_sets_only_what_the_user_left_unset():
    """The thread settings mtpq.cli chooses, in a fresh interpreter: set where unset and listed for child_env;
    a user's own value kept and not listed."""
    code = "import os, mtpq.cli; print(os.environ['OPENBLAS_NUM_THREADS'], os.environ.get('MTPQ_SET_ENV', ''))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS", "MTPQ_SET_ENV")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "OMP_WAIT_POLICY,OPENBLAS_NUM_THREADS"]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OPENBLAS_NUM_THREADS": "4"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["4", "OMP_WAIT_POLICY"]
