"""tokenizer.ggml.* metadata from any Hugging Face fast (byte-level BPE) tokenizer.

Mirrors llama.cpp's ``get_vocab_base``: every id below the model's vocab size
gets a token (padding ids become ``[PAD{i}]``), added tokens are CONTROL or
USER_DEFINED, merges and special ids come from gguf-py's ``SpecialVocab``.
The pre-tokenizer name is looked up by llama.cpp's own fingerprint (the hash of
one probe string's token ids); a tokenizer that splits with GPT-2's plain
byte-level regex gets ``gpt-2`` (the same regex in llama.cpp); any other
unknown tokenizer gets ``default``, which llama.cpp's loader accepts, instead of
a refusal.
"""

from __future__ import annotations

import logging
from hashlib import sha256
from pathlib import Path

import gguf
from gguf import GGUFWriter, TokenType

from ..errors import InputError

log = logging.getLogger(__name__)

# The probe string and fingerprints of llama.cpp's convert_hf_to_gguf (get_vocab_base_pre),
# for the tokenizers of the families mtpq converts.
_PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_PRE = {
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",
    "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
}
FALLBACK_PRE = "default"


def _check_json_object(path: Path) -> dict:
    """A tokenizer file that is not a UTF-8 JSON object is named as such (transformers' own errors blame
    another file or print a multi-line hint)."""
    import json

    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(path, f"not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(path, f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


# what loading a fast tokenizer reads from tokenizer.json (the rest has defaults), and the JSON type of each
_TOKENIZER_KEYS = {"added_tokens": list, "model": dict}
_BPE_KEYS = {"vocab": dict, "merges": list}


def _check_tokenizer_json(path: Path, obj: dict) -> None:
    """tokenizer.json holds what a Hugging Face fast tokenizer saves (transformers' errors say only
    ``KeyError: 'added_tokens'``)."""

    def wrong(where: dict, keys: dict, prefix: str = "") -> list[str]:
        return [
            f"'{prefix}{k}' ({'missing' if k not in where else 'not a JSON ' + _JSON[t]})"
            for k, t in keys.items()
            if not isinstance(where.get(k), t)
        ]

    problems = wrong(obj, _TOKENIZER_KEYS)
    model = obj.get("model")
    if isinstance(model, dict) and model.get("type", "BPE") == "BPE":
        problems += wrong(model, _BPE_KEYS, "model.")
    if problems:
        raise InputError(path, f"not a tokenizer as Hugging Face tokenizers saves it: {', '.join(problems)}")


_JSON = {list: "array", dict: "object"}


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file():
        raise InputError(
            folder / "tokenizer.json", "missing (mtpq converts fast byte-level BPE tokenizers, saved as tokenizer.json)"
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            obj = _check_json_object(folder / name)
            if name == "tokenizer.json":
                _check_tokenizer_json(folder / name, obj)
    from .hfconfig import quiet_transformers

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        text = " ".join(f"{exc.__class__.__name__}: {exc}".split())
        raise InputError(folder, f"cannot load the tokenizer ({text})") from None


def _is_plain_gpt2_byte_level(folder: Path) -> bool:
    """tokenizer.json splits with GPT-2's own regex and nothing else (tokenizers' ByteLevel, use_regex)."""
    import json

    try:
        pre = json.loads((folder / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)


def pre_tokenizer_name(tokenizer, folder: Path | None = None) -> str:
    fingerprint = sha256(str(tokenizer.encode(_PROBE)).encode()).hexdigest()
    name = KNOWN_PRE.get(fingerprint)
    if name is None and folder is not None and _is_plain_gpt2_byte_level(folder):
        return "gpt-2"  # llama.cpp's gpt-2 pre-tokenizer is exactly this regex, whatever the vocab
    if name is None:
        log.warning(
            "unknown pre-tokenizer fingerprint %s; writing tokenizer.ggml.pre=%s", fingerprint[:12], FALLBACK_PRE
        )
        return FALLBACK_PRE
    return name


def write_bpe_vocab(w: GGUFWriter, folder: Path, vocab_size: int, special: dict[str, str] | None = None) -> None:
    """Add the gpt2-style vocab of ``folder`` to ``w``.

    ``special`` maps a special-token role (bos, eos, eot, eom, unk, pad) to the token
    text a family wants there (e.g. GLM: bos=[gMASK]); tokens the tokenizer lacks are skipped.
    """
    tokenizer = load_tokenizer(folder)
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise InputError(
            folder / "tokenizer.json", f"token id {max(vocab.values())} >= vocab_size {vocab_size} of config.json"
        )
    reverse = {i: tok for tok, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        tok = reverse.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif tok in added:
            tokens.append(tok)
            types.append(TokenType.CONTROL if added_decoder[i].special else TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(tokenizer, folder))
    w.add_token_list(tokens)
    w.add_token_types(types)
    sv = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    sv.add_special_token = add_special_flags(folder)
    for role, text in (special or {}).items():
        if text in added:
            sv._set_special_token(role, added[text])
    sv.add_to_gguf(w)


def add_special_flags(folder: Path) -> dict[str, bool]:
    """``tokenizer.ggml.add_{bos,eos,sep}_token`` as llama.cpp's in-tree gguf-py (2026-10) decides them.

    gguf 0.19 (our dependency) lets tokenizer_config.json's ``add_*_token`` override
    what tokenizer.json's post-processor does, and says nothing for a plain ByteLevel
    post-processor. llama.cpp's converter trusts the post-processor (it is what the
    tokenizer really does): ByteLevel adds nothing (both flags false), Roberta adds
    bos/eos/sep, a template adds its leading/trailing special tokens (and a separator
    when its pair template has one between A and B); the config's flags only fill in
    what the post-processor leaves open.
    """
    import json

    def read(name: str):
        f = folder / name
        try:
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except ValueError:
            raise InputError(f, "not valid JSON") from None

    tokenizer, config = read("tokenizer.json"), read("tokenizer_config.json")

    def token(key: str):  # the config's special token text (a string or {"content": ...})
        v = (config or {}).get(key)
        return v.get("content") if isinstance(v, dict) else v

    def special(item: dict):
        return item.get("SpecialToken", {}).get("id")

    flags: dict[str, bool] = {}
    if tokenizer:
        bos, cls, eos, sep = token("bos_token"), token("cls_token"), token("eos_token"), token("sep_token")
        bos, eos = bos or cls, eos or sep
        post = tokenizer.get("post_processor") or {}
        for proc in post.get("processors", [post]) if post else []:
            kind = proc.get("type")
            if kind == "ByteLevel":
                flags.setdefault("bos", False)
                flags.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                flags.update(bos=True, eos=True, sep=True)
            elif kind == "TemplateProcessing":
                single, first, last = proc.get("single", []), None, None
                if len(single) > 1:
                    if first := special(single[0]):
                        if config is None or first not in (bos, cls):
                            bos = bos or first  # a leading special token becomes bos/cls when the config has none
                            cls = cls or first
                        flags["bos"] = config is None or first in (bos, cls)
                    if last := special(single[-1]):
                        eos = last  # the trailing special token is the eos token
                        flags["eos"] = True
                pair = proc.get("pair", [])
                start = 1 if first and pair and special(pair[0]) == first else 0
                stop = -1 if last and pair and special(pair[-1]) == last else None
                pair = pair[start:stop]
                a, b = (
                    (pair[0].get("Sequence", {}).get("id"), pair[-1].get("Sequence", {}).get("id")) if pair else (0, 0)
                )
                if a == "A" and b == "B" and (inner := pair[1:-1]):
                    add_sep = special(inner[0]) in (sep, eos) and not last and special(inner[0]) is not None
                    if len(inner) == 2 and special(inner[1]) is not None and special(inner[1]) in (sep, eos):
                        add_sep = True
                    flags["sep"] = add_sep
    for typ in ("bos", "eos", "sep", "cls", "mask", "pad", "unk", "eot", "eom"):
        value = (config or {}).get(f"add_{typ}_token")
        if isinstance(value, bool) and typ not in flags:
            flags[typ] = value
    return flags
