"""Quantization workers forked once per output file, not once per tensor.

:func:`mtpq.ggml.kernels.quantize` spreads the search-loop types (K- and i-quants) over forked processes.
Forked per call, each tensor paid for a fork and for waiting out the child's exit: 8-10 ms of wall time per
tensor with torch loaded, a quarter of a small model's Q6_K run on 2 cores. Inside :func:`scope` (the
writer opens one per file) the workers are forked at the first such tensor and kept: each call copies its
input rows into an *arena*, anonymous memory mapped shared before the fork, hands out chunk descriptions
through a pipe, and reads the bytes back from a second arena. The children only ever see the arenas, so
memory the parent frees later is not kept alive by them beyond the pool's life.

:meth:`Pool.submit` hands a batch of tasks out and returns; :meth:`Pool.wait` collects one. With a batch
submitted before the one before it is collected, the workers go from one to the next without waiting for the
parent (:mod:`.from_file` keeps two out, in the two halves of the arenas).

No torch here: the arenas are plain mappings, and a child runs the ``handler`` the caller gave when the pool
was made (kernels' chunk runner).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import select
import signal
import struct
import sys
import threading
import warnings
from typing import Callable, Iterator

TASK = struct.Struct("<16q")  # 128 bytes: a pipe's 4096-byte writes hold whole records, each read atomically
REPLY = struct.Struct("<2q")  # (task index, status), then REPLY_TEXT bytes of error text
REPLY_TEXT = 240
OK, INPUT_ERROR, FAILED = 0, 1, 2

IN_BYTES = 64 << 20  # a slab of values (mtpq.gguf_io.buffers.SLAB_ELEMENTS float32) fits whole
OUT_BYTES = 56 << 20  # the bytes of IN_BYTES of float32 in any type (at most 8.5 bits a value: 34 MB)
AUX_BYTES = 4 << 20  # one row of importance weights (float32); its last 4 KB name a file (see from_file)

_lock = threading.Lock()
_state: dict = {"scopes": 0, "pool": None}


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Keep forked workers alive (made at the first call that wants them) until the outermost scope ends."""
    with _lock:
        _state["scopes"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["scopes"] -= 1
            pool = _state["pool"] if _state["scopes"] == 0 else None
            if pool is not None:
                _state["pool"] = None
        if pool is not None:
            pool.close()


def get(workers: int, handler: Callable, tag=None) -> "Pool | None":
    """The scope's pool of ``workers`` processes running ``handler``, forked when the process was in the state
    ``tag`` names (a new tag: forked again, e.g. once tables the handler needs are built); None outside a scope."""
    with _lock:
        if not _state["scopes"]:
            return None
        pool = _state["pool"]
        if pool is not None and not _serves(pool, workers, handler, tag):
            _state["pool"] = None
            pool.close()
            pool = None
        if pool is None:
            pool = _state["pool"] = Pool(workers, handler)
            pool.tag = tag
        return pool


def abandon() -> None:
    """Stop the scope's workers now, tasks still queued or not (an abandoned file); the next call forks anew."""
    with _lock:
        pool, _state["pool"] = _state["pool"], None
    if pool is not None:
        pool.close(kill=True)


def current(workers: int, handler: Callable, tag=None) -> "Pool | None":
    """The pool :func:`get` would return without forking a new one, or None."""
    with _lock:
        pool = _state["pool"]
        return pool if pool is not None and _serves(pool, workers, handler, tag) else None


def _serves(pool: "Pool", workers: int, handler: Callable, tag) -> bool:
    """``pool`` is alive and was made for these: else a new one is forked. PR_SET_PDEATHSIG fires when the
    *thread* that forked a worker ends: a pool made by a thread that is gone has lost its workers."""
    return (pool.workers, pool.handler, pool.tag, pool.alive) == (workers, handler, tag, True) and pool.owner.is_alive()


class WorkerDied(RuntimeError):
    pass


class Pool:
    """``workers`` forked processes waiting for tasks; ``run`` is called by one thread at a time."""

    def __init__(self, workers: int, handler: Callable):
        self.workers, self.handler, self.alive, self.tag = workers, handler, True, None
        self.owner = threading.current_thread()
        self.arena_in = mmap.mmap(-1, IN_BYTES)  # MAP_SHARED: what the parent copies in, the children read
        self.arena_out = mmap.mmap(-1, OUT_BYTES)
        self.arena_aux = mmap.mmap(-1, AUX_BYTES)
        self.run_lock = threading.Lock()
        self._seq, self._unsent, self._batches = 0, bytearray(), []  # task numbers, records not yet written, batches out
        task_r, self.task_w = os.pipe()
        self.reply_r, reply_w = os.pipe()
        self.pids: list[int] = []
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns about fork() in a multi-threaded process; a child runs only the handler's
                # arithmetic on the arenas, takes no lock another thread may hold
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                for _ in range(workers):
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child, which never returns
                        os.close(self.task_w)
                        os.close(self.reply_r)
                        self._serve(task_r, reply_w)
                    self.pids.append(pid)
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            os.close(task_r)
            os.close(reply_w)

    # ----------------------------------------------------------------------------- the child

    def _serve(self, task_r: int, reply_w: int) -> None:  # pragma: no cover - runs in the child
        code = 0
        try:
            die_with_parent()
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
            gc.disable()  # a long life on copied pages: no collections touching (and copying) them
            while True:
                rec = read_all(task_r, TASK.size)
                if len(rec) < TASK.size:
                    break  # the pool closed its end
                task = TASK.unpack(rec)
                try:
                    self.handler(task, self.arena_in, self.arena_out, self.arena_aux)
                    status, text = OK, b""
                except ValueError as e:  # bad input (NaN/Inf, an fp16 overflow): the parent raises it as such
                    status, text = INPUT_ERROR, str(e).encode("utf-8", "replace")
                except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
                    status, text = FAILED, f"{type(e).__name__}: {e}".encode("utf-8", "replace")
                os.write(reply_w, REPLY.pack(task[1], status) + text[:REPLY_TEXT].ljust(REPLY_TEXT, b"\0"))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)

    # ----------------------------------------------------------------------------- the parent

    def run(self, tasks: list[tuple[int, ...]]) -> None:
        """Run ``tasks`` (TASK records, zeros after the fields given) and wait for all of them. Raises the first
        chunk's ValueError (in task order) once every task has answered, so the pool stays usable; a worker that
        died (out of memory?) closes the pool and raises :class:`WorkerDied`."""
        assert not self._batches, "a batch submitted earlier is still out: wait for it first"
        self.wait(self.submit(tasks))

    def submit(self, tasks: list[tuple[int, ...]]) -> "Batch":
        """Hand ``tasks`` out without waiting for them (field 1 of each is replaced by a number of the pool's
        own); :meth:`wait` collects them. Workers take tasks in the order given, batch after batch: a batch
        submitted while another runs keeps them busy across the gap between the two."""
        batch = Batch(self._seq, len(tasks))
        fields = TASK.size // 8  # int64s; a record given fewer has zeros after them
        with self.run_lock:
            self._unsent += b"".join(TASK.pack(t[0], self._seq + k, *t[2:], *(0,) * (fields - len(t)))
                                     for k, t in enumerate(tasks))
            self._seq += len(tasks)
            self._batches.append(batch)
            try:
                self._pump(0.0)  # start them now
            except BaseException:
                self.close(kill=True)
                raise
        return batch

    def wait(self, batch: "Batch") -> None:
        """Wait until every task of ``batch`` has answered; then raise its first chunk's error, if any."""
        with self.run_lock:
            try:
                while batch.left:
                    self._pump(0.5)
            except BaseException:  # a dead worker, or interrupted while tasks were out (their answers would be stale)
                self.close(kill=True)
                raise
        if batch.errors:  # every task answered: the pool stays as it was
            status, text = batch.errors[min(batch.errors)]
            if status == INPUT_ERROR:
                raise ValueError(text)
            raise RuntimeError(f"quantization worker failed: {text}")

    def _pump(self, timeout: float) -> None:
        """Write what the task pipe takes without blocking, read the answers there are (a full task pipe and a
        full reply pipe would otherwise wait on each other)."""
        per_write = 4096 // TASK.size * TASK.size
        reply_size = REPLY.size + REPLY_TEXT
        while True:
            if not self.alive:  # closed meanwhile (abandoned by another thread): no answer will come
                raise WorkerDied("the quantization workers were stopped")
            want_w = [self.task_w] if self._unsent else []
            readable, writable, _ = select.select([self.reply_r], want_w, [], timeout)
            if writable:
                del self._unsent[:os.write(self.task_w, self._unsent[:per_write])]
            if readable:
                msg = read_all(self.reply_r, reply_size)
                if len(msg) < reply_size:
                    raise WorkerDied("quantization workers died (out of memory?)")
                seq, status = REPLY.unpack_from(msg)
                batch = next(b for b in self._batches if b.first <= seq < b.first + b.size)
                if status != OK:
                    batch.errors[seq] = (status, msg[REPLY.size:].rstrip(b"\0").decode("utf-8", "replace"))
                batch.left -= 1
                if not batch.left:
                    self._batches.remove(batch)
                return
            if not writable:
                if timeout:
                    self._check_children()
                return

    def _check_children(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.pids.remove(pid)
                    raise WorkerDied("a quantization worker died (out of memory?)")

    def close(self, kill: bool = False) -> None:
        """End the workers: closing the task pipe lets them leave; ``kill`` (an error, an interrupt) stops them."""
        self.alive = False
        for fd in ("task_w", "reply_r"):
            f = getattr(self, fd, -1)
            if f >= 0:
                with contextlib.suppress(OSError):
                    os.close(f)
                setattr(self, fd, -1)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                if kill:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        self.pids = []


class Batch:
    """Tasks handed out together: numbered ``first`` .. ``first + size - 1``, ``left`` of them unanswered."""

    def __init__(self, first: int, size: int):
        self.first, self.size, self.left = first, size, size
        self.errors: dict[int, tuple[int, str]] = {}


def read_all(fd: int, n: int = -1) -> bytes:
    """``n`` bytes from a pipe (fewer at its end), or everything until its end for n < 0."""
    parts, got = [], 0
    while n < 0 or got < n:
        b = os.read(fd, 65536 if n < 0 else n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def die_with_parent() -> None:
    """In a forked worker: be killed when the thread that forked it ends, even if the parent is killed outright."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def available() -> bool:
    """Forked workers: Linux only (fork is unsafe on macOS, absent on Windows), and not refused."""
    return sys.platform.startswith("linux") and os.environ.get("MTPQ_WORKERS", "fork") != "threads"
