"""Train a small model of any architecture the runtime runs, through mtpq's own runtime: the demo trainer's
route for the families that ``scripts/train_demo.py`` cannot build in transformers (GLM-5, DeepSeek-V3.2/V4,
Qwen3-Next, MiMo-V2.5, Step-3.5, Nemotron 3, Hy3, Command A, Ling 3). A head that lives in a file of its own
(DeepSeek-V4: llama.cpp's ``-md``) trains with its trunk, given as ``--head``, and both files are written.

It starts from an f32 GGUF that ``mtpq convert`` wrote from a release-shaped checkpoint (tests/releases: the
release's own config keys and tensor names, sizes shrunk) and trains every float tensor of the file in place,
the runtime's forward pass being the model: the GGUF's tensors become parameters, and each step rebuilds the
runtime's model around them (:func:`mtpq.runtime.families.load`), so whatever a family derives from its tensors
at load (fused projections, split latents) is differentiated through. The losses are the demo's (DESIGN.md):

    trunk: cross-entropy of x_{t+1};  head: cross-entropy of x_{t+2} from the pair (h_t, x_{t+1})

with the head's pairs laid out as the runtime's teacher-forced passes lay them (:meth:`MtpModel.head_rows`).
Only the first head trains (greedy k=1 drafting runs it alone); a family's later chained heads keep their values.
The corpus is the demo's: the Python standard library's own ``*.py`` files, the demo's held-out files left out,
tokenized with the checkpoint's tokenizer (the one the GGUF carries). The trained tensors are written over the
input's, metadata and every other tensor as they were, to a temporary name renamed into place.

    PYTHONPATH=. .venv/bin/python scripts/train_family.py IN.gguf CKPT_FOLDER OUT.gguf --steps 300
    PYTHONPATH=. .venv/bin/python scripts/train_family.py TRUNK.gguf CKPT OUT.gguf --head HEAD.gguf --head-out OUTH.gguf

Deterministic given --seed and --threads.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import sysconfig
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo import read, stdlib_files  # noqa: E402 (scripts/ is on sys.path)

from mtpq.ggml.types import FLOAT_TYPES  # noqa: E402
from mtpq.gguf_io import GGUFFile, plan_from_gguf, write_plan  # noqa: E402
from mtpq.gguf_io.pair import PairedGGUF  # noqa: E402
from mtpq.runtime.layers import Packing  # noqa: E402
from mtpq.runtime.model import MtpModel  # noqa: E402
from mtpq.runtime.weights import QWeight, _float_from_reader  # noqa: E402
from mtpq.tensors import block_index  # noqa: E402


def parameters_of(g: GGUFFile) -> dict[str, torch.Tensor]:
    """Every float tensor of ``g`` as a trainable f32 tensor, in torch order (rows, row length)."""
    out = {}
    for name, t in g.tensors.items():
        qtype = t.tensor_type
        if qtype in FLOAT_TYPES and qtype.name != "I32":
            out[name] = _float_from_reader(t.data, qtype, g.shape(name)).float().requires_grad_(True)
    return out


@contextlib.contextmanager
def weights_from(params: dict[str, torch.Tensor]):
    """While open, the runtime's weights of a float tensor named in ``params`` are that tensor itself (so the
    model built inside is differentiable in them); any other tensor loads from the file as usual."""
    plain = QWeight.from_reader.__func__

    def from_reader(cls, t, shape, device, dtype, pool=None):
        p = params.get(t.name)
        if p is None:
            return plain(cls, t, shape, device, dtype, pool)
        return cls(t.tensor_type, shape, p, dtype, name=t.name, pool={})

    with mock.patch.object(QWeight, "from_reader", classmethod(from_reader)):
        yield


def model_on(g: GGUFFile, params: dict[str, torch.Tensor]) -> MtpModel:
    from mtpq.runtime.families import load

    with weights_from(params):
        return load(g.path, g=g)


def losses(model: MtpModel, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trunk CE, head CE, head top-1 accuracy) over ``windows`` [B, T], packed into one pass as the runtime's
    teacher-forced estimator packs sequences."""
    B, T = windows.shape
    lengths = [T] * B
    seq = windows.reshape(1, B * T)
    trunk = type(model).trunk.__wrapped__(model, seq, use_cache=False, packing=Packing(lengths, model.device))
    V = trunk.logits.shape[-1]
    logits = trunk.logits.reshape(B, T, V)
    trunk_ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), windows[:, 1:].reshape(-1))
    ids, states, packing = model.head_rows(seq, trunk.hidden, lengths)
    drafted = type(model).draft.__wrapped__(model, ids, states, use_cache=False, packing=packing)
    # one output per pair (h_t, x_{t+1}), t = 0..T-2, predicting x_{t+2}: the last has no target here
    head = drafted.logits.reshape(B, T - 1, V)[:, :-1]
    head_ce = F.cross_entropy(head.reshape(-1, V), windows[:, 2:].reshape(-1))
    acc = (head.argmax(-1) == windows[:, 2:]).float().mean()
    return trunk_ce, head_ce, acc


def corpus_ids(tokenizer_json: Path, stdlib: Path) -> torch.Tensor:
    """The demo's training files (its held-out ones left out), tokenized and joined."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    train_files, _ = stdlib_files(stdlib)
    ids: list[int] = []
    for enc in tok.encode_batch([read(p) for p in train_files]):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def write_trained(src: Path, out: Path, trained: dict[str, np.ndarray]) -> None:
    """``src`` with each tensor named in ``trained`` replaced, to a temporary name renamed to ``out``."""
    plan = plan_from_gguf(Path(src))
    plan.tensors = [
        s.with_values(lambda s=s: trained[s.name].reshape(s.load().shape)) if s.name in trained else s
        for s in plan.tensors
    ]
    tmp = out.with_name(out.name + ".partial")
    write_plan(plan, tmp)
    tmp.replace(out)


def head_file_names(g: PairedGGUF, head: Path) -> dict[str, str]:
    """The head file's tensor names -> the names the paired view gives them (its MTP blocks' own; its top-level
    tensors the head block reads, under ``blk.N.nextn.``), matched by where their data lies in the head file."""
    paired = {}
    for name, t in g.tensors.items():
        b = block_index(name)
        if b is not None and b >= g.n_trunk:
            if t.data_offset in paired:
                raise SystemExit(f"error: {head}: two tensors of the head read the same data; not trainable here")
            paired[t.data_offset] = name
    return {name: paired[t.data_offset] for name, t in GGUFFile(head).tensors.items() if t.data_offset in paired}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(
    src: Path,
    tokenizer_json: Path,
    out: Path,
    steps: int = 300,
    batch: int = 8,
    seq: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    stdlib: Path | None = None,
    log_every: int = 50,
    head: Path | None = None,
    head_out: Path | None = None,
) -> dict:
    """Train ``src``'s float tensors (see the module's docstring), with ``head``'s where the head lives in a file
    of its own, and write the result to ``out`` (and ``head_out``)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    g = GGUFFile(Path(src)) if head is None else PairedGGUF(Path(src), Path(head))
    params = parameters_of(g)
    stream = corpus_ids(tokenizer_json, stdlib or Path(sysconfig.get_paths()["stdlib"]))
    matrices = [p for p in params.values() if p.dim() >= 2]
    vectors = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    t0, ema, first = time.time(), None, None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1))
        starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
        windows = torch.stack([stream[s : s + seq] for s in starts.tolist()])
        model = model_on(g, params)
        trunk_ce, head_ce, acc = losses(model, windows)
        if not torch.isfinite(trunk_ce + head_ce):
            raise SystemExit(f"error: {src}: the loss is not finite at step {step + 1}")
        (trunk_ce + head_ce).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = np.array([trunk_ce.item(), head_ce.item(), acc.item()])
        first = cur if first is None else first
        ema = cur if ema is None else 0.95 * ema + 0.05 * cur
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(
                f"step {step + 1:4d}/{steps}  loss trunk {ema[0]:.3f}  head {ema[1]:.3f}  head top-1 {ema[2]:.3f}  "
                f"{time.time() - t0:5.0f} s",
                flush=True,
            )
    trained = {n: p.detach().numpy() for n, p in params.items()}
    if head is not None:  # the head's tensors first: the trunk file's of the same name are the trunk's own
        names = head_file_names(g, Path(head))
        write_trained(Path(head), head_out, {f: trained[n] for f, n in names.items() if n in trained})
        trained = {n: v for n, v in trained.items() if n not in set(names.values())}
    write_trained(Path(src), out, trained)
    return {
        "steps": steps,
        "seconds": round(time.time() - t0, 1),
        "loss_trunk": [round(float(first[0]), 3), round(float(ema[0]), 3)],
        "loss_head": [round(float(first[1]), 3), round(float(ema[1]), 3)],
        "head_top1": round(float(ema[2]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="an f32 GGUF mtpq convert wrote")
    ap.add_argument("tokenizer", type=Path, help="the checkpoint folder it was converted from (its tokenizer.json)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--head", type=Path, help="the head file of a trunk-only IN (DeepSeek-V4), trained with it")
    ap.add_argument("--head-out", type=Path, help="where the trained head file goes (with --head)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = a.tokenizer / "tokenizer.json" if a.tokenizer.is_dir() else a.tokenizer
    if (a.head is None) != (a.head_out is None):
        ap.error("--head and --head-out go together")
    print(train(a.src, tok, a.out, a.steps, a.batch, a.seq, a.lr, a.seed, head=a.head, head_out=a.head_out))


if __name__ == "__main__":
    main()
