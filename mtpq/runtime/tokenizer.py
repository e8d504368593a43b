"""Rebuild a Hugging Face fast tokenizer from a GGUF's ``tokenizer.ggml.*`` metadata.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: every family mtpq
converts) is supported. The pieces:
- vocab from ``tokenizer.ggml.tokens`` (id = position), merges from ``tokenizer.ggml.merges``;
- CONTROL tokens become special added tokens, USER_DEFINED tokens plain added
  tokens (both matched before BPE, as in the original tokenizer);
- the pre-tokenizer from ``tokenizer.ggml.pre``: the same split regexes llama.cpp
  uses for that name (llama-vocab.cpp), then byte-level mapping. ``default`` is
  what mtpq writes for a tokenizer llama.cpp has no fingerprint for; it is read
  as llama.cpp reads it (its own default split list: punctuation runs, GPT-2's
  regex, digit runs, then triples of digits), so acceptance is measured on the
  tokens llama.cpp will feed the model;
- ``glm4``/``glm5``/``llama3`` BPE with ``ignore_merges`` (whole words found in the vocab
  are kept as they are), as llama.cpp does for those names;
- bos/eos/unk/pad ids, ``add_bos_token`` and the chat template.

    tok = tokenizer_from_gguf(GGUFFile(path))   # encode/decode now; the rest of a transformers
                                                # PreTrainedTokenizerFast (chat template ...) on first use
"""

from __future__ import annotations

import logging

from gguf import TokenType

from ..errors import InputError
from .weights import GGUFFile

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT list (its GPT-2 splitter falls back to \s+ as GPT-2's regex does)
_LLAMA_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2 + r"|\s+", r"\p{N}+", r"[0-9][0-9][0-9]"]
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges). None: GPT-2's ByteLevel regex.
PRE_TOKENIZERS: dict[str, tuple[list[str] | None, bool]] = {
    "default": (_LLAMA_DEFAULT, False),
    "gpt-2": (None, False),
    "glm4": ([_LLAMA3], True),  # llama.cpp's CHATGLM4 regex is llama3's
    "glm5": ([_LLAMA3], True),
    "chatglm-bpe": ([_LLAMA3], False),
    "llama3": ([_LLAMA3], True),
    "llama-bpe": ([_LLAMA3], True),
    "qwen2": ([_QWEN2], False),
    "qwen35": ([_QWEN35], False),
    "deepseek-v3": (_DEEPSEEK3, False),
}


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        log.warning("tokenizer.ggml.pre=%r is not known to mtpq; using GPT-2's byte-level regex", pre)
    regexes, _ = PRE_TOKENIZERS.get(pre, (None, False))
    if regexes is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(g: GGUFFile):
    """A tokenizer equivalent to the one the GGUF was converted from (see :class:`RuntimeTokenizer`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = g.kv.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(g.path, f"tokenizer.ggml.model is {kind!r}; the runtime rebuilds only 'gpt2' (byte-level BPE)")
    tokens: list[str] = list(g.kv.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise InputError(g.path, "no tokenizer.ggml.tokens")
    types = list(g.kv.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in g.kv.get("tokenizer.ggml.merges") or []]
    pre = g.kv.get("tokenizer.ggml.pre", "default")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate keeps its first id, as llama.cpp's token_to_id does
    ignore_merges = PRE_TOKENIZERS.get(pre, (None, False))[1]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=ty == TokenType.CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tok.add_tokens(added)

    def special(role: str) -> str | None:
        i = g.kv.get(f"tokenizer.ggml.{role}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = special("bos")
    if g.kv.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )

    def full():
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=bos,
            eos_token=special("eos"),
            unk_token=special("unknown"),
            pad_token=special("padding"),
        )
        if (template := g.kv.get("tokenizer.chat_template")) is not None:
            fast.chat_template = template
        return fast

    return RuntimeTokenizer(
        tok,
        full,
        bos_token_id=tok.token_to_id(bos) if bos else None,
        eos_token_id=tok.token_to_id(eos) if (eos := special("eos")) else None,
    )


class RuntimeTokenizer:
    """``encode``/``decode`` straight on the ``tokenizers`` object; everything else from the equivalent
    transformers ``PreTrainedTokenizerFast``, built on first use: importing transformers costs about a
    second, which an acceptance report (encode only) need not pay."""

    def __init__(self, tok, build_full, bos_token_id: int | None, eos_token_id: int | None):
        self._tok, self._build_full, self._full = tok, build_full, None
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids with the special tokens the GGUF adds (BOS when add_bos_token), as transformers'."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is None:
            self._full = self._build_full()
        return getattr(self._full, name)
