"""llama.cpp as the acceptance engine: ``llama-server`` drafting with the GGUF's own MTP head.

The bundled torch runtime holds a model on one device; the quants people make of 100-700 B
models run on several GPUs, a big Mac or llama.cpp's RPC backend across machines, and llama.cpp
is what will serve them. Here mtpq starts ``llama-server --spec-type draft-mtp`` (or talks to one
already running), sends the same prompts with the same sampling settings, and reads each
response's ``timings.draft_n`` / ``timings.draft_n_accepted`` into the same report as the torch
engine's (``mtpq.acceptance.report.AcceptReport``).

    cfg = ServerConfig(find_server(None), ngl=999)
    report = measure_with_llama_cpp("big-q4km.gguf", prompts, draft=3, max_new_tokens=64, server=cfg)

The server's life is ours: a unix socket in a private temporary folder (no other process can be
listening there, unlike a TCP port picked free and bound later, which a second server started at
the same moment can take: then mtpq would read that server's counters), a ready check with a
timeout, its log in a file (kept and named when anything fails), one line with the reason from that log when it cannot
start, and no server left behind: it runs in its own process group, is stopped on every exit path
(including Ctrl-C and SIGTERM, which mtpq turns into exceptions), and on Linux dies with mtpq even
when mtpq is killed outright.

Only the standard library talks HTTP here (urllib, and http.client over the unix socket): no new
dependency. ``--server`` takes ``http(s)://HOST:PORT`` or ``unix:/path/to/llama.sock`` (llama-server
``--host /path/to/llama.sock``).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..acceptance.metrics import DraftTotals, GenerationResult, metrics_from_totals
from ..acceptance.prompts import load_prompts
from ..acceptance.report import AcceptReport, PromptRun
from ..errors import InputError
from .binaries import ENV_BIN, child_env, find_binary, reason_from_log  # noqa: F401  (shared by the engines)

SERVER_BINARY = "llama-server"
READY_TIMEOUT = 600.0  # seconds for a server to load its model (a 300 GB quant over a slow disk needs minutes)
REQUEST_TIMEOUT = 3600.0
PER_POSITION_NOTE = "llama-server reports per-request totals: per-position rates only at k=1"


def find_server(bin_dir: Path | str | None = None) -> Path:
    """``llama-server`` from ``--llama-cpp DIR``, else ``$MTPQ_LLAMA_CPP_BIN``, else PATH."""
    return find_binary(SERVER_BINARY, bin_dir)


@dataclass
class ServerConfig:
    """How to start llama-server; ``extra`` goes to it verbatim (e.g. ``--tensor-split 1,1``)."""

    binary: Path
    ngl: int | None = None  # layers on the GPU(s): llama-server's -ngl
    ctx_size: int | None = None
    threads: int | None = None
    rpc: str | None = None  # HOST:PORT,HOST:PORT of rpc-server processes
    extra: list[str] = field(default_factory=list)
    ready_timeout: float = READY_TIMEOUT

    def args(self, model: Path, draft: int, host: str) -> list[str]:
        a = [
            str(self.binary),
            "-m",
            str(model),
            "--host",
            host,
            "--spec-type",
            "draft-mtp",
            "--spec-draft-n-max",
            str(draft),
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            "0",  # every round drafts k tokens, as the torch engine's loop does
            "-np",
            "1",
            "--no-webui",
        ]
        for flag, value in (("-ngl", self.ngl), ("-c", self.ctx_size), ("-t", self.threads), ("--rpc", self.rpc)):
            if value is not None:
                a += [flag, str(value)]
        return a + list(self.extra)


def with_draft_model(cfg: ServerConfig, head: Path) -> ServerConfig:
    """``cfg`` serving a trunk with a head file (``mtp-*.gguf``) as its MTP draft model: ``-md``, and ``-ngld``
    as ``-ngl`` (the draft model's layers go where the trunk's go)."""
    from dataclasses import replace

    from ..gguf_io.files import first_shard

    extra = ["-md", str(first_shard(Path(head)))] + (["-ngld", str(cfg.ngl)] if cfg.ngl is not None else [])
    return replace(cfg, extra=[*extra, *cfg.extra])


def _die_with_parent() -> None:
    """In the child, before exec: its own process group, and (Linux) SIGTERM when mtpq dies, even by SIGKILL."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class LlamaServer:
    """A llama-server process for one model: ``with LlamaServer(cfg, model, draft) as srv: srv.url``."""

    def __init__(self, cfg: ServerConfig, model: Path, draft: int):
        from ..gguf_io.files import first_shard

        # llama.cpp loads a split model from shard 1 only (any shard may be given): the set is checked here,
        # so that a missing shard is one line before any server starts
        self.cfg, self.model, self.draft = cfg, first_shard(model), draft
        # llama-server binds a path ending in .sock as a unix socket; the folder is ours alone
        self.socket_dir = Path(tempfile.mkdtemp(prefix="mtpq-llama-server-"))
        self.socket = self.socket_dir / "llama-server.sock"
        self.url = f"unix:{self.socket}"
        fd, name = tempfile.mkstemp(prefix="mtpq-llama-server-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        try:
            self.start()
        except BaseException:
            self.stop(keep_log=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(keep_log=exc_type is not None)

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.cfg.args(self.model, self.draft, str(self.socket)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(),
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + self.cfg.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise InputError(
                    self.model,
                    f"llama-server could not start: {reason_from_log(self._log_text())} "
                    f"(exit {self.proc.returncode}; log: {self.log})",
                )
            if _health(self.url):
                return
            if time.monotonic() > deadline:
                raise InputError(
                    self.model, f"llama-server was not ready after {self.cfg.ready_timeout:.0f} s (log: {self.log})"
                )
            time.sleep(0.2)

    def stop(self, keep_log: bool = False) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if not keep_log:
            self.log.unlink(missing_ok=True)

    def _log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _request(url: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
    """GET (no body) or POST JSON -> (HTTP status, payload) for any answer; OSError when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    if url.startswith("unix:"):
        conn = _UnixHTTPConnection(url[len("unix:") :], timeout)
        try:
            conn.request("GET" if data is None else "POST", path, body=data, headers=headers)
            r = conn.getresponse()
            return r.status, r.read()
        except http.client.HTTPException as e:
            raise OSError(f"bad HTTP answer: {e}") from None
        finally:
            conn.close()
    req = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError as e:
        raise OSError(str(e.reason)) from None


def _health(url: str) -> bool:
    try:
        return _request(url, "/health", None, timeout=2)[0] == 200
    except (OSError, ValueError):
        return False


def _post(url: str, path: str, body: dict, timeout: float) -> dict:
    try:
        status, payload = _request(url, path, body, timeout)
    except (OSError, ValueError) as e:
        raise InputError(url, f"cannot reach llama-server: {e}") from None
    if status != 200:
        detail = payload.decode(errors="replace")[:300].strip()
        raise InputError(url, f"llama-server answered {status} to {path}: {detail}")
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        raise InputError(url, f"llama-server's answer to {path} is not JSON") from None


def complete(
    url: str,
    prompt: str,
    *,
    n_predict: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    timeout: float = REQUEST_TIMEOUT,
) -> tuple[GenerationResult, DraftTotals]:
    """One request -> (the generation, its draft totals). The sampler chain is the torch engine's:
    temperature, top-k, top-p only (llama.cpp's default min-p 0.05 is switched off)."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": 0.0,
        "seed": seed,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    res = _post(url, "/completion", body, timeout)
    t = res.get("timings")
    if not isinstance(t, dict) or "predicted_n" not in t:
        raise InputError(url, "llama-server's /completion answer has no timings: is this a llama-server?")
    if "draft_n" not in t:
        raise InputError(
            url, "llama-server drafted nothing: start it with --spec-type draft-mtp on a GGUF that has an MTP head"
        )
    generated = int(t["predicted_n"])
    seconds = (float(t.get("prompt_ms", 0.0)) + float(t.get("predicted_ms", 0.0))) / 1000.0
    tokens = [int(x) for x in res.get("tokens") or []]
    gen = GenerationResult(prompt_len=int(t.get("prompt_n", 0)), tokens=tokens, k=0, seconds=seconds)
    totals = DraftTotals(
        generated=generated, drafted=int(t["draft_n"]), accepted=int(t["draft_n_accepted"]), seconds=seconds, k=0
    )
    return gen, totals


def measure_with_llama_cpp(
    model: Path | str | None,
    prompts: str | Path | list[tuple[str, str]] = "builtin",
    draft: int = 3,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompts: int | None = None,
    server: ServerConfig | None = None,
    url: str | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
) -> AcceptReport:
    """Acceptance through llama-server: a server started for ``model`` from ``server``, or the one at ``url``."""
    if (server is None) == (url is None):
        raise ValueError("give exactly one of server (to start one) and url (one already running)")
    if not 1 <= draft <= 8:
        raise InputError("--draft", "must be between 1 and 8")
    pairs = load_prompts(prompts, max_prompts) if not isinstance(prompts, list) else prompts
    if url is not None:
        return _measure(
            url.rstrip("/"), str(model or url), pairs, draft, max_new_tokens, temperature, top_k, top_p, seed, on_prompt
        )
    model = Path(model)
    with LlamaServer(server, model, draft) as srv:
        return _measure(srv.url, str(model), pairs, draft, max_new_tokens, temperature, top_k, top_p, seed, on_prompt)


def _measure(url, label, pairs, draft, max_new_tokens, temperature, top_k, top_p, seed, on_prompt) -> AcceptReport:
    runs, totals = [], []
    for i, (cat, text) in enumerate(pairs):
        gen, tot = complete(
            url, text, n_predict=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i
        )
        gen.k = tot.k = draft
        runs.append(PromptRun(cat, text, gen, None))
        totals.append((cat, tot))
        if on_prompt:
            on_prompt(i + 1, len(pairs))
    by_cat: dict[str, list[DraftTotals]] = {}
    for cat, tot in totals:
        by_cat.setdefault(cat, []).append(tot)
    return AcceptReport(
        model=label,
        draft=draft,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        runs=runs,
        overall=metrics_from_totals([t for _, t in totals]),
        by_category={c: metrics_from_totals(v) for c, v in by_cat.items()},
        plain_tokens_per_s=None,
        greedy_outputs_identical=None,
        device="llama.cpp",
        engine="llama.cpp",
        extra={"server": url, "note": PER_POSITION_NOTE},
    )
