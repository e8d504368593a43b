"""How a build's files are named and laid out, and which files llama.cpp's ``-hf OWNER/NAME:TAG`` picks from them.

Layouts (the recipe's ``[model] layout``):

- ``combined``: one file per quant with the head inside, ``NAME-TAG.gguf``.
- ``sidecar``: trunk-only quants ``NAME-TAG.gguf`` and one head file ``mtp-NAME-HEAD.gguf`` per distinct head
  (``HEAD``: the head's type, ``Q8_0``, ``F16``...), shared by every quant that uses it. This is how
  ``llama-server -hf OWNER/NAME:TAG --spec-type draft-mtp`` downloads a model and its head.
- ``both``: the sidecar files plus the combined ones, named ``NAME-TAG_MTP.gguf``: the ``_`` keeps llama.cpp's
  ``TAG[.-]`` pattern off them, so ``-hf OWNER/NAME:TAG`` still resolves to the trunk alone.

llama.cpp's selection (common/download.cpp), mirrored here so that a recipe whose names would make it pick the
wrong file is refused before anything is built:

- the model for ``TAG`` is the first file in the repository listing whose path matches ``TAG[.-]``
  (case-insensitive) and is a model: a ``.gguf`` whose file name holds none of ``mmproj``, ``imatrix``,
  ``mtp-``, ``eagle3-``, ``dflash-``, ``dspark-``; of a split set only shard 1;
- the head is the ``.gguf`` whose path holds ``mtp-``, in the model's folder or one above it, preferring the
  deepest folder, then a name holding ``-TAG.``, then the nearest quantization bits (the first number of the
  tag, ``Q4_K_M`` -> 4, ``F16`` -> 16) to the tag's. Ties go to the listing order, which offline is the
  file system's: a layout is accepted only when the intended file wins outright.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUTS = ("combined", "sidecar", "both")
HEAD_PREFIX = "mtp-"
COMBINED_SUFFIX = "_MTP"  # layout "both": the combined file's tag; '_' is not in llama.cpp's TAG[.-]
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


def model_file(name: str, tag: str) -> str:
    return f"{name}-{tag}.gguf"


def combined_file(name: str, tag: str, layout: str) -> str:
    """The file holding trunk and head: ``NAME-TAG.gguf``, or beside a trunk of that name ``NAME-TAG_MTP.gguf``."""
    return model_file(name, tag if layout == "combined" else tag + COMBINED_SUFFIX)


def head_file(name: str, label: str) -> str:
    return f"{HEAD_PREFIX}{name}-{label}.gguf"


def head_label(mtp_type: str, experts_type: str | None = None) -> str:
    """A head's name in its file name: its type (``Q8_0``), and its experts' when those differ
    (``Q8_0_EXPS_Q4_K``: llama.cpp reads the bits from the first number, 8)."""
    label = mtp_type.upper()
    if experts_type is not None and experts_type.upper() != label:
        label += f"_EXPS_{experts_type.upper()}"
    return label


# ----------------------------------------------------------------------------- llama.cpp's -hf selection


@dataclass(frozen=True)
class _Split:
    prefix: str
    tag: str
    index: int
    count: int


def _split_info(path: str) -> _Split:
    prefix = path[: -len(".gguf")] if path.endswith(".gguf") else path
    index = count = 1
    if m := _SPLIT.match(prefix):
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    m = _TAG.search(prefix)
    return _Split(prefix, m.group(1).upper() if m else "", index, count)


def _leading_bits(tag: str) -> int:
    """The number that starts at the tag's first digit (llama.cpp: stoi from find_first_of("0123456789"))."""
    m = re.search(r"[0-9]+", tag)
    return int(m.group()) if m else 0


def quant_bits(path: str) -> int:
    """llama.cpp's extract_quant_bits: the first number in a file's tag (``Q4_K_M`` -> 4, ``BF16`` -> 16)."""
    return _leading_bits(_split_info(path).tag)


def is_model(path: str) -> bool:
    """llama.cpp's gguf_filename_is_model: a .gguf whose file name (not folder) holds none of NOT_MODELS."""
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def models_for_tag(paths: list[str], tag: str) -> list[str]:
    """Every file llama.cpp may take as the model for ``-hf REPO:TAG`` (it takes the first it lists)."""
    pattern = re.compile(re.escape(tag) + "[.-]", re.IGNORECASE) if tag else None
    hits = []
    for p in paths:
        split = _split_info(p)
        if is_model(p) and (pattern is None or pattern.search(p)) and not (split.count > 1 and split.index != 1):
            hits.append(p)
    return hits


def heads_for(paths: list[str], model: str, tag: str, keyword: str = HEAD_PREFIX) -> list[str]:
    """The head files llama.cpp's find_best_mtp ranks first for ``model`` fetched as ``REPO:TAG`` (all of them
    when several tie: then the listing order decides)."""
    upper = tag.upper()
    model_bits = _leading_bits(upper) if upper else quant_bits(model)
    model_dirs = model.split("/")[:-1]
    ranked = []
    for p in paths:
        if not p.endswith(".gguf") or keyword not in p:
            continue
        dirs = p.split("/")[:-1]
        if dirs != model_dirs[: len(dirs)]:  # only the model's folder or one above it
            continue
        exact = bool(upper) and f"-{upper}." in p.upper()
        ranked.append(((len(dirs), exact, -abs(quant_bits(p) - model_bits)), p))
    if not ranked:
        return []
    best = max(r for r, _ in ranked)
    return [p for r, p in ranked if r == best]


def resolution_problems(paths: list[str], pairs: dict[str, tuple[str, str | None]]) -> list[str]:
    """What goes wrong when llama.cpp resolves ``-hf REPO:TAG --spec-type draft-mtp`` in a repository holding
    ``paths``, for each ``TAG -> (intended model file, intended head file or None)``."""
    problems = []
    for tag, (model, head) in pairs.items():
        models = models_for_tag(paths, tag)
        if models != [model]:
            got = ", ".join(models) or "no file"
            problems.append(f"-hf REPO:{tag} would find {got} as the model, not {model} alone")
            continue
        if head is None:
            continue
        heads = heads_for(paths, model, tag)
        if heads != [head]:
            got = " and ".join(heads) or "no head"
            problems.append(f"-hf REPO:{tag} --spec-type draft-mtp would pair {model} with {got}, not {head}")
    return problems
