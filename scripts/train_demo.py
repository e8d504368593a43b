"""Train mtpq's demo models: a tiny GLM-4.5 (``Glm4MoeForCausalLM``, the default) or, with
``--family qwen35``, a tiny Qwen3.5 (``Qwen3_5ForCausalLM``), each with one MTP layer.

What it builds (the family-specific parts are in ``scripts/demo_families.py``)
    A GLM-4.5-architecture model of 6.7 M trained parameters (7.7 M saved, with the
    head's copies of embedding and LM head): hidden 256, 4 layers (1 dense
    + 3 MoE with 4 routed experts, top-2, 1 shared expert, sigmoid routing with a
    correction bias) plus one NextN/MTP layer, trained on the Python standard
    library's own ``*.py`` files (offline, the running interpreter's stdlib), with
    a 2048-token byte-level BPE trained by the tokenizers library.

    Trunk: next-token loss. MTP head: next-next-token loss (DESIGN.md):
        u = eh_proj([enorm(Emb[x_{t+1}]); hnorm(h_t)]),  g = Block(u),
        logits = shared_head.head(shared_head.norm(g)),
    h_t = the trunk's hidden state AFTER its final norm. The head shares the
    trunk's embedding and LM head (as transformers' and DeepSeek-V3's MTP do);
    they are saved again under the head's own names, so llama.cpp (which reads
    ``nextn.embed_tokens``/``shared_head_head``) and transformers (which uses the
    trunk's) compute the same drafts. The trunk's final norm starts from a wide
    log-normal spread so that post-norm and pre-norm hidden states point in
    different directions: feeding the head the wrong one measurably costs
    acceptance (printed at the end).

    ``--family qwen35``: a Qwen3.5 of 4.5 M trunk parameters (hidden 256, 3 gated-DeltaNet
    layers + 1 gated full-attention layer, dense SwiGLU 768, 2 key / 4 value heads in the
    linear attention) plus the ``mtp.*`` layer (fc over [pre_fc_norm_embedding(E[x]);
    pre_fc_norm_hidden(h_t)], one gated full-attention layer, mtp.norm), sharing the trunk's
    embedding and LM head as the releases do; same corpus, tokenizer recipe and losses; the
    zero-centred final norm (1 + w) gets the same log-normal spread. Transformers does not
    run Qwen3.5's head, so its reload check rebuilds the head from the saved ``mtp.*`` tensors
    with transformers' own decoder layer, norm and rotary embedding.

    The tokenizer's pre-tokenizer reproduces llama.cpp's ``default`` BPE
    pre-tokenizer (the one mtpq's converter writes for tokenizers it has no
    fingerprint for), so HF and llama.cpp split text the same way.

Rerun (from the repo root; one thread by default: ~20 min of training + ~2 min of
evaluation on an idle core, about 26 min in all on the shared 2-core dev box)
    make install                                                  # the repo's .venv, as for the tests
    PYTHONPATH=. .venv/bin/python scripts/train_demo.py           # -> mtpq/data/demo,
                                                                  # mtpq/data/prompts/demo_heldout.jsonl
    PYTHONPATH=. .venv/bin/python scripts/train_demo.py --family qwen35   # -> mtpq/data/demo_qwen35 (~45 min)
    PYTHONPATH=. .venv/bin/python scripts/train_demo.py --steps 200 --out demo-smoke \
        --prompts-out demo-smoke.jsonl                            # quick smoke run (~5 min)

    Deterministic given --seed, --threads and the stdlib folder (the same Python
    version gives the same corpus). The output folder is written to a temporary
    sibling and renamed into place only when complete. The held-out prompt set
    depends only on the corpus and the tokenizer, not on the training run.

What it prints
    corpus and tokenizer statistics, a loss line every --log-every steps, then
    held-out losses (trunk next-token, MTP next-next-token, MTP top-1 accuracy on
    real text), depth-1 greedy acceptance on the held-out prompt set and on a
    wider held-out sample, each with the post-norm (right) and the pre-norm
    (wrong) hidden state, and finally a reload check: the saved folder is read
    back (trunk: transformers' ``from_pretrained``; GLM's head: transformers' own ``MtpModel``
    loader; Qwen3.5's: rebuilt from the files) and must reproduce the acceptance.
    The same numbers go to ``<out>/demo_training.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from demo_families import FAMILIES, LLAMA_DEFAULT_PRE, DemoModel  # noqa: E402 (scripts/ is on sys.path)


@dataclass
class Args:
    out: Path
    prompts_out: Path
    stdlib: Path
    family: str = "glm4moe"
    seed: int = 0
    threads: int = 1  # 1 beats 2 on a shared 2-core box: OpenMP barriers stall under contention
    vocab: int = 2048
    steps: int = 1600
    batch: int = 8
    seq: int = 256
    lr: float = 3e-3
    min_lr_frac: float = 0.05
    warmup: int = 100
    mtp_weight: float = 0.5
    norm_spread: float = 1.5  # std of log(final norm weight) at init
    bias_update: float = 1e-3  # aux-loss-free expert balancing step (DeepSeek-V3)
    new_tokens: int = 128
    log_every: int = 100


# --------------------------------------------------------------------------- corpus + tokenizer


def stdlib_files(stdlib: Path) -> tuple[list[Path], list[Path]]:
    """Top-level stdlib modules, sorted by name; every 8th file (index % 8 == 5) is held out."""
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if len(files) < 40:
        sys.exit(f"error: {stdlib}: only {len(files)} *.py files; pass --stdlib with a CPython Lib folder")
    train = [p for i, p in enumerate(files) if i % 8 != 5]
    held = [p for i, p in enumerate(files) if i % 8 == 5]
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab: int, specials: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in LLAMA_DEFAULT_PRE]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, folder: Path, fam) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    # keep the chat template inside tokenizer_config.json, no BOS/EOS added on encode
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        chat_template=fam.chat_template,
        add_bos_token=False,
        add_eos_token=False,
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=4096,
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def token_stream(tok, texts: list[str], sep: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model (the rest: demo_families.py)


def eos_ids(fam) -> list[int]:
    """The family's stop tokens (the tokenizer trainer puts the specials first, in order)."""
    return [fam.specials.index(t) for t in fam.stop_tokens]


# --------------------------------------------------------------------------- training


def lr_at(step: int, a: Args) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def losses(model: DemoModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trunk next-token CE, head next-next-token CE, head top-1 accuracy, for windows x [B, T+1]."""
    T = x.shape[1] - 1
    h, _ = model.trunk(x[:, :T])
    v = model.lm.config.vocab_size
    trunk = F.cross_entropy(model.lm.lm_head(h).reshape(-1, v), x[:, 1:].reshape(-1))
    head = model.head_logits(h[:, : T - 1], x[:, 1:T])
    mtp = F.cross_entropy(head.reshape(-1, v), x[:, 2:].reshape(-1))
    acc = (head.argmax(-1) == x[:, 2:]).float().mean()
    return trunk, mtp, acc


def train(model: DemoModel, fam, stream: torch.Tensor, a: Args, gen: torch.Generator) -> dict:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    loads: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: loads.append(o[2].detach())) for r in fam.routers(model)]
    model.train()
    t0, ema = time.time(), None
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        starts = torch.randint(0, len(stream) - a.seq - 1, (a.batch,), generator=gen)
        x = torch.stack([stream[s : s + a.seq + 1] for s in starts.tolist()])
        loads.clear()
        trunk, mtp, _ = losses(model, x)
        (trunk + a.mtp_weight * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # aux-loss-free balancing: nudge the correction bias toward under-used experts
            for r, idx in zip(fam.routers(model), loads):
                counts = torch.bincount(idx.flatten(), minlength=r.num_experts).float()
                r.e_score_correction_bias += a.bias_update * torch.sign(counts.mean() - counts)
        cur = torch.tensor([trunk.item(), mtp.item()])
        ema = cur if ema is None else 0.98 * ema + 0.02 * cur
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            el = time.time() - t0
            print(
                f"step {step + 1:5d}/{a.steps}  loss trunk {ema[0]:.3f}  mtp {ema[1]:.3f}  lr {lr_at(step, a):.2e}  "
                f"{el / 60:5.1f} min  {(step + 1) * a.batch * a.seq / el:6.0f} tok/s",
                flush=True,
            )
    for h in hooks:
        h.remove()
    model.eval()
    return {
        "train_loss_trunk_ema": round(float(ema[0]), 4),
        "train_loss_mtp_ema": round(float(ema[1]), 4),
        "train_minutes": round((time.time() - t0) / 60, 2),
    }


# --------------------------------------------------------------------------- held-out prompts and acceptance

_DEF = re.compile(r"^\s*(async\s+)?def \w+\(.*\):\s*$")
_DOC_OPEN = re.compile(r'^\s+(r?""")(?!.*""").+$')  # opens a multi-line docstring with text on the same line
_BODY = re.compile(r"^ {8,}\S.*[^\\,(\[{]$")


def cut_prompts(tok, held: list[Path], per_cat: int, gen: torch.Generator, max_tokens: int = 96) -> list[dict]:
    """Prompts cut from held-out files, each ending at a line end (without the newline, so the
    continuation starts with the next line's newline+indent token, as in training)."""
    cats = {"def": _DEF, "docstring": _DOC_OPEN, "body": _BODY}
    out: list[dict] = []
    for c_i, (cat, pat) in enumerate(cats.items()):
        got = 0
        for f_i in range(len(held)):
            if got == per_cat:
                break
            f = held[(f_i + 3 * c_i) % len(held)]  # rotate files per category so prompts come from many modules
            lines = read(f).split("\n")
            cands = [i for i, ln in enumerate(lines) if pat.match(ln) and i >= 6]
            if not cands:
                continue
            i = cands[int(torch.randint(0, len(cands), (1,), generator=gen))]
            lo = max(0, i - 14)
            while True:  # drop leading lines until the prompt fits max_tokens
                text = "\n".join(lines[lo : i + 1])
                if len(tok.encode(text).ids) <= max_tokens or lo == i:
                    break
                lo += 1
            if len(tok.encode(text).ids) > max_tokens or len(text) < 40:
                continue
            out.append({"category": cat, "prompt": text, "source": f.name})
            got += 1
    return out


@torch.no_grad()
def greedy(model: DemoModel, prompt: list[int], n: int) -> list[int]:
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    cache = DynamicCache(config=model.lm.config)
    out = model.lm(input_ids=ids, past_key_values=cache, use_cache=True)
    seq = list(prompt)
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        seq.append(nxt)
        out = model.lm(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    return seq


@torch.no_grad()
def acceptance(model: DemoModel, tok, prompts: list[dict], n_new: int, head_fn=None) -> dict:
    """Teacher-forced depth-1 greedy acceptance over greedy continuations.

    For each prompt (P tokens) the trunk continues greedily for n_new tokens; one pass over the
    whole sequence gives, at every t with x_{t+1} generated, the head's draft argmax head(h_t, x_{t+1})
    and the trunk's next greedy token argmax trunk(.)[t+1]; a draft is accepted when they agree.
    ``head_fn(seq, h) -> logits`` (h: the trunk hidden state under test) replaces the in-script head (used for the
    reload check).
    """
    acc = {"post": [0, 0], "pre": [0, 0]}
    per_cat: dict[str, list[int]] = {}
    for p in prompts:
        ids = tok.encode(p["prompt"]).ids
        seq = torch.tensor([greedy(model, ids, n_new)])
        P = len(ids)
        h_post, h_pre = model.trunk(seq, want_pre=True)
        target = model.lm.lm_head(h_post)[0].argmax(-1)  # trunk greedy token after each position
        ts = torch.arange(P - 1, seq.shape[1] - 1)  # x_{t+1} is generated
        for kind, h in (("post", h_post), ("pre", h_pre)):
            if head_fn is not None:
                logits = head_fn(seq, h_post if kind == "post" else h_pre)
            else:
                logits = model.head_logits(h[:, :-1], seq[:, 1:])
            draft = logits[0].argmax(-1)  # entry t drafts x_{t+2}
            hit = int((draft[ts] == target[ts + 1]).sum())
            acc[kind][0] += hit
            acc[kind][1] += len(ts)
            if kind == "post":
                c = per_cat.setdefault(p["category"], [0, 0])
                c[0] += hit
                c[1] += len(ts)
    rate = {k: v[0] / max(1, v[1]) for k, v in acc.items()}
    return {
        "accept_post_norm": round(rate["post"], 4),
        "accept_pre_norm": round(rate["pre"], 4),
        "drafted": acc["post"][1],
        "per_category": {k: round(v[0] / v[1], 4) for k, v in sorted(per_cat.items())},
    }


@torch.no_grad()
def heldout_losses(model: DemoModel, stream: torch.Tensor, a: Args) -> dict:
    gen = torch.Generator().manual_seed(a.seed + 7)
    tot = torch.zeros(3)
    n = 24
    for _ in range(n // 4):
        starts = torch.randint(0, len(stream) - a.seq - 1, (4,), generator=gen)
        x = torch.stack([stream[s : s + a.seq + 1] for s in starts.tolist()])
        tot += torch.tensor([float(v) for v in losses(model, x)])
    tot /= n // 4
    return {
        "heldout_loss_trunk": round(float(tot[0]), 4),
        "heldout_loss_mtp": round(float(tot[1]), 4),
        "heldout_mtp_top1": round(float(tot[2]), 4),
    }


# --------------------------------------------------------------------------- saving


def checkpoint_tensors(model: DemoModel, fam, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Trunk as transformers saves it + the MTP layer under the family's checkpoint names."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.lm.save_pretrained(d, safe_serialization=True)
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            sd.update(load_file(str(f)))
    sd.update(fam.mtp_tensors(model))
    return {
        k: (v.detach().float() if k.endswith(fam.f32_suffixes) else v.detach().to(dtype)).contiguous()
        for k, v in sd.items()
    }


def save_folder(folder: Path, model: DemoModel, fam, tok, dtype: torch.dtype, record: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    tensors = checkpoint_tensors(model, fam, dtype)
    cfg = model.lm.config.to_dict()
    cfg.update(architectures=[fam.architecture], dtype=str(dtype).removeprefix("torch."))
    cfg.pop("_name_or_path", None)
    fam.extra_config(cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    mtp_prefix = fam.mtp_prefix(model.lm.config)
    shards = [
        sorted(k for k in tensors if not k.startswith(mtp_prefix)),
        sorted(k for k in tensors if k.startswith(mtp_prefix)),
    ]
    weight_map = {}
    for i, names in enumerate(shards):  # shard 2 holds the MTP layer, as the releases' last shards do
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(folder / fname), metadata={"format": "pt"})
        (folder / fname).chmod(0o644)  # safetensors creates shards 0600; package data must be world-readable
        weight_map.update({n: fname for n in names})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    gen_cfg = {
        "_from_model_config": False,
        "eos_token_id": eos_ids(fam),
        "pad_token_id": eos_ids(fam)[0],
        "do_sample": False,
    }
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_tokenizer(tok, folder, fam)
    (folder / "demo_training.json").write_text(json.dumps(record, indent=2) + "\n")


def replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)


# --------------------------------------------------------------------------- reload check (transformers as oracle)


def reload_check(folder: Path, fam, prompts: list[dict], n_new: int, tok) -> dict:
    """Read the saved folder back (transformers for the trunk, the family's independent head
    reader for the MTP layer) and recompute the acceptance."""
    shell, head_fn = fam.reload(folder)
    return acceptance(shell, tok, prompts, n_new, head_fn=head_fn)


# --------------------------------------------------------------------------- main


def parse() -> Args:
    repo = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="glm4moe")
    ap.add_argument("--out", type=Path, help="default: mtpq/data/demo (glm4moe), mtpq/data/demo_<family> (others)")
    ap.add_argument("--prompts-out", type=Path, help="default: mtpq/data/prompts/demo[_<family>]_heldout.jsonl")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    for f, v in asdict(Args(Path(), Path(), Path())).items():
        if f not in ("out", "prompts_out", "stdlib", "family"):
            ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    a = Args(**vars(ap.parse_args()))
    suffix = "" if a.family == "glm4moe" else "_" + a.family  # the GLM demo keeps its historical paths
    a.out = a.out or repo / f"mtpq/data/demo{suffix}"
    a.prompts_out = a.prompts_out or repo / f"mtpq/data/prompts/demo{suffix}_heldout.jsonl"
    return a


def _portable(value) -> str:
    """An argument as recorded: a path inside the repository relative to it, the standard library by name (no
    machine's paths in the packaged record)."""
    text = str(value)
    repo = Path(__file__).resolve().parent.parent
    try:
        return str(Path(text).resolve().relative_to(repo))
    except (ValueError, OSError):
        pass
    if Path(text).resolve() == Path(sysconfig.get_paths()["stdlib"]).resolve():
        return f"<stdlib of Python {sys.version.split()[0]}>"
    return text


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the reload check's "unexpected MTP keys" report is expected
    transformers.utils.logging.disable_progress_bar()
    gen = torch.Generator().manual_seed(a.seed)

    train_files, held_files = stdlib_files(a.stdlib)
    train_texts, held_texts = [read(p) for p in train_files], [read(p) for p in held_files]
    fam = FAMILIES[a.family]
    tok = train_tokenizer(train_texts, a.vocab, fam.specials)
    assert all(tok.token_to_id(t) == i for i, t in enumerate(fam.specials)), "special tokens must come first"
    sep = tok.token_to_id("<|endoftext|>")
    train_ids, held_ids = token_stream(tok, train_texts, sep), token_stream(tok, held_texts, sep)
    corpus_hash = hashlib.sha256(
        "".join(p.name + "\0" + t for p, t in zip(train_files, train_texts)).encode()
    ).hexdigest()
    print(
        f"corpus: {a.stdlib} ({sys.version.split()[0]}): {len(train_files)} train files "
        f"{sum(map(len, train_texts)) / 1e6:.2f} MB -> {len(train_ids) / 1e6:.2f} M tokens; "
        f"{len(held_files)} held-out files -> {len(held_ids) / 1e6:.2f} M tokens; vocab {tok.get_vocab_size()}",
        flush=True,
    )

    config = fam.make_config(tok.get_vocab_size(), eos_ids(fam))
    model = fam.build(config, a.norm_spread, gen)
    n_trunk = sum(p.numel() for p in model.lm.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    print(
        f"model: trunk {n_trunk / 1e6:.2f} M params, MTP layer {n_mtp / 1e6:.2f} M (+ shared embedding/head)",
        flush=True,
    )
    record: dict = {
        "args": {k: _portable(v) for k, v in asdict(a).items()},
        "python": sys.version.split()[0],
        "train_files": len(train_files),
        "heldout_files": [p.name for p in held_files],
        "train_corpus_sha256": corpus_hash,
        "train_tokens": len(train_ids),
        "params_trunk": n_trunk,
        "params_mtp_layer": n_mtp,
    }
    record.update(train(model, fam, train_ids, a, gen))

    dtype = torch.bfloat16
    with torch.no_grad():  # measure what ships: weights rounded to the checkpoint dtype
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    record.update(heldout_losses(model, held_ids, a))
    print(
        f"held-out: loss trunk {record['heldout_loss_trunk']:.3f}  mtp {record['heldout_loss_mtp']:.3f}  "
        f"mtp top-1 on real text {record['heldout_mtp_top1']:.3f}",
        flush=True,
    )

    prompts = cut_prompts(tok, held_files, per_cat=8, gen=torch.Generator().manual_seed(a.seed + 1))
    wide = cut_prompts(tok, held_files, per_cat=len(held_files), gen=torch.Generator().manual_seed(a.seed + 2))
    t = time.time()
    record["acceptance_prompts"] = acceptance(model, tok, prompts, a.new_tokens)
    record["acceptance_wide"] = acceptance(model, tok, wide, a.new_tokens)
    for key, what in (
        ("acceptance_prompts", f"{len(prompts)} prompts of demo_heldout.jsonl"),
        ("acceptance_wide", f"{len(wide)} wider held-out prompts"),
    ):
        r = record[key]
        print(
            f"depth-1 greedy acceptance ({what}, {r['drafted']} drafts, {a.new_tokens} new tokens each): "
            f"post-norm h {100 * r['accept_post_norm']:.1f} %   pre-norm h {100 * r['accept_pre_norm']:.1f} %   "
            f"by category {r['per_category']}",
            flush=True,
        )
    print(f"(acceptance took {time.time() - t:.0f} s)")

    tmp = a.out.with_name(a.out.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save_folder(tmp, model, fam, tok, dtype, record)
        check = reload_check(tmp, fam, prompts, a.new_tokens, tok)
        same = check["accept_post_norm"] == record["acceptance_prompts"]["accept_post_norm"]
        print(
            f"reload check (from the saved files): post-norm {100 * check['accept_post_norm']:.1f} %  "
            f"pre-norm {100 * check['accept_pre_norm']:.1f} %  -> {'same' if same else 'DIFFERENT'}",
            flush=True,
        )
        if not same:
            sys.exit("error: the saved checkpoint does not reproduce the in-script acceptance")
        record["reload_check"] = check
        (tmp / "demo_training.json").write_text(json.dumps(record, indent=2) + "\n")
        replace_dir(tmp, a.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_jsonl_atomic(a.prompts_out, [{"category": p["category"], "prompt": p["prompt"]} for p in prompts])
    size = sum(f.stat().st_size for f in a.out.iterdir())
    print(f"wrote {a.out} ({size / 1e6:.1f} MB) and {a.prompts_out} ({len(prompts)} prompts)")


if __name__ == "__main__":
    main()
