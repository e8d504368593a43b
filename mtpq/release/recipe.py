"""The build recipe: a TOML file that names a checkpoint, its variants and the acceptance gate.

    [model]
    name = "GLM-4.5-Air"          # artifact file names start with this
    source = "./GLM-4.5-Air"      # HF checkpoint folder (relative to the recipe)
    output = "dist"               # output folder (relative to the recipe)
    reference_type = "bf16"       # the reference GGUF converted once: f32, f16, bf16 or q8_0
    split_max_size = "48G"        # optional: shards of at most this much (Hugging Face takes files up to 50 GB);
                                  #   a file that fits stays whole
    layout = "sidecar"            # optional: "combined" (default: one file per quant, head inside), "sidecar"
                                  #   (trunk-only quants + one mtp-NAME-TYPE.gguf per distinct head, the files
                                  #   llama-server -hf OWNER/NAME:TAG --spec-type draft-mtp fetches) or "both"
                                  #   (the sidecar files + NAME-TAG_MTP.gguf with the head inside)

    [gate]                        # optional: the acceptance check every variant must pass
    prompts = "builtin"           # or a JSONL file of {"category", "prompt"}
    draft = 3                     # draft depth k
    max_new_tokens = 64
    min_rate = 0.30               # fail below this acceptance rate
    max_drop = 0.10               # fail when the rate drops more than this below the reference
    # text = "wiki.test.raw"      # optional: score the trunk against the reference on this text, as
    # max_kld = 0.05              #   llama-perplexity --kl-divergence does (mtpq compare), and fail a variant
    # min_top1 = 0.90             #   whose mean KLD, same-top fraction or PPL ratio misses these;
    # max_ppl_ratio = 1.05        #   kld_ctx_size (default 512) and kld_chunks (default all) pick the chunks
    # engine = "llama.cpp"        # measure with llama-server's MTP drafting instead of the torch runtime,
    # ngl = 999                   #   with its options: llama_cpp (bin folder), ngl, ctx_size, threads,
    # rpc = "10.0.0.2:50052"      #   rpc, server_args = ["--tensor-split", "1,1"]

    [[variant]]
    name = "Q4_K_M"
    preset = "Q4_K_M"
    mtp_type = "q8_0"             # default q8_0; "same" quantizes the head like the trunk, "keep" holds the
                                  # reference type, "auto" measures (the narrowest head within auto_max_drop,
                                  # default 0.02, of f16's)
    tensor_types = ["attn_v=q8_0"]  # optional llama-quantize style overrides
    # imatrix = "glm-air.imatrix.gguf"  # optional: importance matrix (llama-imatrix GGUF or .dat), as
    #                                   # llama-quantize --imatrix; its sha256 goes into the manifest
    # exclude_weights = ["ffn_down"]    # optional, with imatrix: llama-quantize's --exclude/--include-weights
    # graft_into = "published-Q4_K_M.gguf"  # optional: give this existing quant the reference's head
    # gate = false                # optional: build without the acceptance gate
    # split_max_size = "20G"      # optional: this variant's shard size (default: [model]'s)

    [extras]                      # layout "combined" only (the sidecar layouts publish the reference's head and trunk)
    mtp_only = true               # also publish the head-only GGUF
    no_mtp = false                # also publish a trunk-only GGUF

    [publish]                     # optional: where `mtpq publish` / `mtpq build --push` upload, and the model card
    repo = "OWNER/GLM-4.5-Air-MTP-GGUF"
    base_model = "zai-org/GLM-4.5-Air"   # the Hub id of the source model (the card's base_model)
    quantized_by = "OWNER"
    license = "mit"               # optional
    private = false               # optional: a repository created by the upload is private

Every error names the recipe key at fault (``recipe.toml: variant[2].preset: ...``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from ..engines import ENGINES
from ..errors import InputError
from ..quantize.mtp_precision import Q8_0, MtpPrecision, parse_mtp
from ..workflows.gates import Gate
from . import layout as naming

REFERENCE_TYPES = ("f32", "f16", "bf16", "q8_0")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# a Hub repository id, as huggingface_hub validates it: OWNER/NAME of letters, digits, '-', '_', '.'
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


LLAMA_CPP_GATE_KEYS = ("llama_cpp", "ngl", "ctx_size", "rpc", "server_args")
QUALITY_GATE_KEYS = ("text", "kld_ctx_size", "kld_chunks", "max_kld", "min_top1", "max_ppl_ratio")


@dataclass(frozen=True)
class Variant:
    name: str
    preset: str
    mtp_type: MtpPrecision = Q8_0
    mtp_experts_type: MtpPrecision | None = None
    tensor_types: tuple[str, ...] = ()
    graft_into: Path | None = None
    gate: bool = True
    imatrix: Path | None = None
    include_weights: tuple[str, ...] = ()
    exclude_weights: tuple[str, ...] = ()
    split_max_size: int | None = None  # bytes per shard; None: the recipe's
    auto_max_drop: float | None = None  # mtp_type = "auto": the head type measured (see mtpq quantize --mtp-type auto)

    @property
    def head_like_trunk(self) -> bool:
        """mtp_type (or mtp_experts_type) "same": the head is quantized as this variant's trunk is."""
        return self.mtp_type.is_same or (self.mtp_experts_type is not None and self.mtp_experts_type.is_same)


@dataclass(frozen=True)
class Publish:
    """Where the build goes on the Hub and what its model card says about it."""

    repo: str | None = None
    base_model: str | None = None
    quantized_by: str | None = None
    license: str | None = None
    private: bool = False


@dataclass
class Recipe:
    path: Path
    name: str
    source: Path
    output: Path
    reference_type: str
    variants: list[Variant]
    gate: Gate | None
    mtp_only: bool = False
    no_mtp: bool = False
    raw_sha256: str = ""
    extras: dict = field(default_factory=dict)
    split_max_size: int = 0  # bytes per shard of every artifact (0: whole files); a variant may say otherwise
    layout: str = "combined"  # see mtpq.release.layout
    publish: Publish = field(default_factory=Publish)

    @property
    def sidecar(self) -> bool:
        """Trunk-only quants paired with head files (layouts "sidecar" and "both")."""
        return self.layout != "combined"

    def head_label(self, v: Variant | None) -> str:
        """The label of a head file (``mtp-NAME-LABEL.gguf``): the head's type (the reference's for ``keep``;
        ``v`` None: the reference's own head), or for a head quantized like its trunk (``same``) the variant's
        name, since no other quant shares it."""
        if v is None:
            return self.reference_type.upper()
        if v.head_like_trunk:
            return v.name

        def type_name(p: MtpPrecision | None) -> str | None:
            return None if p is None else self.reference_type if p.is_keep else str(p)

        return naming.head_label(type_name(v.mtp_type), type_name(v.mtp_experts_type))

    def split_of(self, v: Variant | None) -> int:
        """The shard size of an artifact: its variant's, else the recipe's (0: one file)."""
        return v.split_max_size if v is not None and v.split_max_size is not None else self.split_max_size

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise InputError(
            self.path, f"--variant {name!r} is not in the recipe (have: {', '.join(v.name for v in self.variants)})"
        )


def _err(path: Path, key: str, problem: str) -> InputError:
    return InputError(path, f"{key}: {problem}")


def _take(table: dict, key: str, kind, path: Path, where: str, default=None, required=False):
    if key not in table:
        if required:
            raise _err(path, f"{where}.{key}" if where else key, "missing")
        return default
    val = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if not isinstance(val, kinds) or (isinstance(val, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise _err(path, f"{where}.{key}" if where else key, f"expected {want}, got {val!r}")
    return val


def _check_unknown(table: dict, allowed: set[str], path: Path, where: str) -> None:
    for k in table:
        if k not in allowed:
            raise _err(path, f"{where}.{k}" if where else k, f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _split_size(table: dict, path: Path, where: str) -> int | None:
    """``split_max_size``: bytes, or a string with K, M or G as llama.cpp's tools take it ("48G")."""
    if "split_max_size" not in table:
        return None
    from ..gguf_io import parse_size

    try:
        return parse_size(_take(table, "split_max_size", (str, int), path, where))
    except ValueError as exc:
        raise _err(path, f"{where}.split_max_size", str(exc)) from None


def _imatrix_keys(v: dict, path: Path, where: str, base: Path, check_inputs: bool):
    """A variant's ``imatrix`` (checked readable as an imatrix file) and its weight selections."""
    name = _take(v, "imatrix", str, path, where)
    lists = []
    for key in ("include_weights", "exclude_weights"):
        items = _take(v, key, list, path, where, default=[])
        if not all(isinstance(x, str) and x for x in items):
            raise _err(path, f"{where}.{key}", "expected a list of non-empty strings")
        if items and name is None:
            raise _err(path, f"{where}.{key}", "needs imatrix")
        lists.append(tuple(items))
    if lists[0] and lists[1]:
        raise _err(path, f"{where}.include_weights", "cannot be combined with exclude_weights")
    if name is None:
        return None, lists
    imatrix = base / name
    if check_inputs:
        from ..quantize.imatrix import read_imatrix

        try:
            read_imatrix(imatrix)
        except InputError as exc:
            raise _err(path, f"{where}.imatrix", f"{imatrix}: {exc.problem}") from None
    return imatrix, lists


def load_recipe(path: Path, check_inputs: bool = True) -> Recipe:
    """Parse and validate a recipe; ``check_inputs=False`` (for --merge) does not require the source folder."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "no such recipe file")
    raw = path.read_bytes()
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(path, f"not valid TOML ({exc})") from None
    _check_unknown(doc, {"model", "gate", "variant", "extras", "publish"}, path, "")
    base = path.parent

    model = _take(doc, "model", dict, path, "", required=True)
    _check_unknown(model, {"name", "source", "output", "reference_type", "split_max_size", "layout"}, path, "model")
    name = _take(model, "name", str, path, "model", required=True)
    if not _NAME.match(name):
        raise _err(path, "model.name", f"{name!r} must be letters, digits, '.', '_' or '-' (it starts file names)")
    source = base / _take(model, "source", str, path, "model", required=True)
    if check_inputs and not source.is_dir():
        raise _err(path, "model.source", f"{source} is not a folder")
    output = base / _take(model, "output", str, path, "model", default="dist")
    if output.exists() and not output.is_dir():
        raise _err(path, "model.output", f"{output} is a file, not a folder")
    if check_inputs and output.resolve().is_relative_to(source.resolve()):
        raise _err(path, "model.output", f"{output} is inside the source checkpoint {source}; choose another folder")
    ref_type = _take(model, "reference_type", str, path, "model", default="bf16").lower()
    if ref_type not in REFERENCE_TYPES:
        raise _err(path, "model.reference_type", f"{ref_type!r} is not one of {', '.join(REFERENCE_TYPES)}")
    layout = _take(model, "layout", str, path, "model", default="combined")
    if layout not in naming.LAYOUTS:
        raise _err(path, "model.layout", f"{layout!r} is not one of {', '.join(naming.LAYOUTS)}")

    gate = None
    if "gate" in doc:
        g = _take(doc, "gate", dict, path, "")
        _check_unknown(
            g,
            {
                "prompts",
                "draft",
                "max_new_tokens",
                "min_rate",
                "max_drop",
                "temperature",
                "max_prompts",
                "engine",
                "threads",
                *LLAMA_CPP_GATE_KEYS,
                *QUALITY_GATE_KEYS,
            },
            path,
            "gate",
        )
        prompts = _take(g, "prompts", str, path, "gate", default="builtin")
        if prompts != "builtin" and not (base / prompts).is_file():
            raise _err(path, "gate.prompts", f"{base / prompts} does not exist")
        gate = Gate(
            prompts=prompts if prompts == "builtin" else str(base / prompts),
            draft=_take(g, "draft", int, path, "gate", default=3),
            max_new_tokens=_take(g, "max_new_tokens", int, path, "gate", default=64),
            min_rate=_take(g, "min_rate", float, path, "gate"),
            max_drop=_take(g, "max_drop", float, path, "gate"),
            temperature=_take(g, "temperature", float, path, "gate", default=0.0),
            max_prompts=_take(g, "max_prompts", int, path, "gate"),
            engine=_take(g, "engine", str, path, "gate", default="torch"),
            llama_cpp=str(base / lc) if (lc := _take(g, "llama_cpp", str, path, "gate")) else None,
            ngl=_take(g, "ngl", int, path, "gate"),
            ctx_size=_take(g, "ctx_size", int, path, "gate"),
            threads=_take(g, "threads", int, path, "gate"),
            rpc=_take(g, "rpc", str, path, "gate"),
            server_args=tuple(_take(g, "server_args", list, path, "gate", default=[])),
            text=str(base / t) if (t := _take(g, "text", str, path, "gate")) else None,
            kld_ctx_size=_take(g, "kld_ctx_size", int, path, "gate", default=512),
            kld_chunks=_take(g, "kld_chunks", int, path, "gate"),
            max_kld=_take(g, "max_kld", float, path, "gate"),
            min_top1=_take(g, "min_top1", float, path, "gate"),
            max_ppl_ratio=_take(g, "max_ppl_ratio", float, path, "gate"),
        )
        if gate.text is not None and not Path(gate.text).is_file():
            raise _err(path, "gate.text", f"{gate.text} does not exist")
        for k in ("max_kld", "min_top1", "max_ppl_ratio", "kld_chunks"):
            if getattr(gate, k) is not None and gate.text is None:
                raise _err(path, f"gate.{k}", "needs gate.text (the text the trunk is scored on)")
        if gate.kld_ctx_size < 4 or (gate.kld_chunks is not None and gate.kld_chunks < 1):
            key = "kld_ctx_size" if gate.kld_ctx_size < 4 else "kld_chunks"
            raise _err(path, f"gate.{key}", f"must be at least {4 if key == 'kld_ctx_size' else 1}")
        for k in ("max_kld", "max_ppl_ratio"):
            if (v := getattr(gate, k)) is not None and not v >= 0:
                raise _err(path, f"gate.{k}", f"must be 0 or more, got {v}")
        if gate.min_top1 is not None and not 0.0 <= gate.min_top1 <= 1.0:
            raise _err(path, "gate.min_top1", "must be between 0 and 1")
        if gate.engine not in ENGINES:
            raise _err(path, "gate.engine", f"choose one of {', '.join(ENGINES)}, got {gate.engine!r}")
        if gate.engine == "torch":
            for k in LLAMA_CPP_GATE_KEYS:
                if k in g:
                    raise _err(path, f"gate.{k}", 'belongs to engine = "llama.cpp"')
        for j, a in enumerate(gate.server_args):
            if not isinstance(a, str):
                raise _err(path, f"gate.server_args[{j}]", f"expected a string, got {a!r}")
        for k in ("ngl", "ctx_size", "threads"):
            v = getattr(gate, k)
            if v is not None and v < (0 if k == "ngl" else 1):
                raise _err(path, f"gate.{k}", f"must be {'0 or more' if k == 'ngl' else 'at least 1'}, got {v}")
        if not 1 <= gate.draft <= 8:
            raise _err(path, "gate.draft", "must be between 1 and 8")
        if gate.max_new_tokens < 1:
            raise _err(path, "gate.max_new_tokens", f"must be at least 1, got {gate.max_new_tokens}")
        if not 0.0 <= gate.temperature < float("inf"):
            raise _err(path, "gate.temperature", f"must be 0 (greedy) or positive, got {gate.temperature}")
        if gate.max_prompts is not None and gate.max_prompts < 1:
            raise _err(path, "gate.max_prompts", f"must be at least 1, got {gate.max_prompts}")
        for k in ("min_rate", "max_drop"):
            v = getattr(gate, k)
            if v is not None and not 0.0 <= v <= 1.0:
                raise _err(path, f"gate.{k}", "must be between 0 and 1")

    from ..quantize.mtp_precision import MtpPrecisionKind
    from ..quantize.presets import preset_named, type_named  # llama-quantize's names
    from ..quantize.surgery import GRAFT_KINDS

    def check(fn, value: str, key: str):
        try:
            return fn(value, key)
        except InputError as exc:
            raise _err(path, key, exc.problem) from None

    variants = []
    tables = _take(doc, "variant", list, path, "", required=True)
    if not tables:
        raise _err(path, "variant", "at least one [[variant]] is needed")
    for i, v in enumerate(tables):
        where = f"variant[{i}]"
        if not isinstance(v, dict):
            raise _err(path, where, "must be a table")
        _check_unknown(
            v,
            {
                "name",
                "preset",
                "mtp_type",
                "mtp_experts_type",
                "tensor_types",
                "graft_into",
                "gate",
                "imatrix",
                "include_weights",
                "exclude_weights",
                "split_max_size",
                "auto_max_drop",
            },
            path,
            where,
        )
        vname = _take(v, "name", str, path, where, required=True)
        if not _NAME.match(vname):
            raise _err(path, f"{where}.name", f"{vname!r} must be letters, digits, '.', '_' or '-'")
        preset = check(preset_named, _take(v, "preset", str, path, where, required=True), f"{where}.preset").name
        graft = _take(v, "graft_into", str, path, where)
        # parsed once here; the runner hands the typed values on (graft cannot follow 'same': no trunk rule)
        allow = GRAFT_KINDS if graft is not None else tuple(MtpPrecisionKind)
        parse = lambda val, key: parse_mtp(val, key, allow=allow)  # noqa: E731
        mtp_text = _take(v, "mtp_type", str, path, where, default="q8_0")
        auto = mtp_text.strip().lower() == "auto"
        auto_max_drop = _take(v, "auto_max_drop", float, path, where, default=0.02 if auto else None)
        if auto_max_drop is not None and not auto:
            raise _err(path, f"{where}.auto_max_drop", 'goes with mtp_type = "auto"')
        if auto and graft is not None:
            raise _err(path, f"{where}.mtp_type", '"auto" measures a quantized head: not with graft_into')
        if auto_max_drop is not None and not 0.0 <= auto_max_drop <= 1.0:
            raise _err(path, f"{where}.auto_max_drop", "must be between 0 and 1")
        # "auto": the trunk is written with the reference's head, then the measured type replaces it
        mtp_type = check(parse, "keep" if auto else mtp_text, f"{where}.mtp_type")
        mtp_experts = _take(v, "mtp_experts_type", str, path, where)
        if mtp_experts is not None:
            if graft is not None:
                raise _err(path, f"{where}.mtp_experts_type", "not used with graft_into (the head gets mtp_type)")
            mtp_experts = check(parse, mtp_experts, f"{where}.mtp_experts_type")
        overrides = _take(v, "tensor_types", list, path, where, default=[])
        for j, o in enumerate(overrides):
            if not isinstance(o, str) or "=" not in o:
                raise _err(path, f"{where}.tensor_types[{j}]", f"expected 'REGEX=TYPE', got {o!r}")
            pattern, typ = o.rsplit("=", 1)
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _err(path, f"{where}.tensor_types[{j}]", f"bad regex {pattern!r}: {exc}") from None
            check(type_named, typ, f"{where}.tensor_types[{j}]")
        if check_inputs and graft is not None and not (base / graft).is_file():
            raise _err(path, f"{where}.graft_into", f"{base / graft} does not exist")
        imatrix, weights = _imatrix_keys(v, path, where, base, check_inputs)
        if imatrix is not None and graft is not None:
            raise _err(path, f"{where}.imatrix", "a grafted variant is not quantized: drop imatrix or graft_into")
        variants.append(
            Variant(
                vname,
                preset,
                mtp_type,
                mtp_experts,
                tuple(overrides),
                base / graft if graft else None,
                _take(v, "gate", bool, path, where, default=True),
                imatrix,
                *weights,
                _split_size(v, path, where),
                auto_max_drop,
            )
        )
    names = [v.name for v in variants]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise _err(path, "variant", f"duplicate variant name {sorted(dupes)[0]!r}")

    extras = _take(doc, "extras", dict, path, "", default={})
    _check_unknown(extras, {"mtp_only", "no_mtp"}, path, "extras")
    recipe = Recipe(
        path=path,
        name=name,
        source=source,
        output=output,
        reference_type=ref_type,
        variants=variants,
        gate=gate,
        mtp_only=_take(extras, "mtp_only", bool, path, "extras", default=False),
        no_mtp=_take(extras, "no_mtp", bool, path, "extras", default=False),
        raw_sha256=hashlib.sha256(raw).hexdigest(),
        split_max_size=_split_size(model, path, "model") or 0,
        layout=layout,
        publish=_publish(doc, path),
    )
    if recipe.sidecar:
        _check_sidecar_layout(recipe)
    return recipe


def _publish(doc: dict, path: Path) -> Publish:
    table = _take(doc, "publish", dict, path, "", default={})
    _check_unknown(table, {"repo", "base_model", "quantized_by", "license", "private"}, path, "publish")
    got = {k: _take(table, k, str, path, "publish") for k in ("repo", "base_model", "quantized_by", "license")}
    for key in ("repo", "base_model"):
        if got[key] is not None and not REPO_ID.match(got[key]):
            raise _err(path, f"publish.{key}", f"{got[key]!r} is not a Hugging Face repository id (OWNER/NAME)")
    return Publish(**got, private=_take(table, "private", bool, path, "publish", default=False))


def _check_sidecar_layout(recipe: Recipe) -> None:
    """What the sidecar layouts cannot do, and names llama.cpp would resolve to the wrong files: refused here,
    before anything is built."""
    path = recipe.path
    for key in ("mtp_only", "no_mtp"):
        if getattr(recipe, key):
            raise _err(
                path,
                f"extras.{key}",
                f'layout = "{recipe.layout}" already publishes the reference\'s trunk '
                f"and its head ({naming.head_file(recipe.name, recipe.head_label(None))}); drop [extras]",
            )
    for i, v in enumerate(recipe.variants):
        if v.auto_max_drop is not None:
            raise _err(
                path,
                f"variant[{i}].mtp_type",
                '"auto" measures the head inside one quant; with layout '
                f'"{recipe.layout}" name the head type (mtpq quantize --mtp-type auto tells which)',
            )
    made = {recipe.head_label(None): ("model.reference_type", recipe.reference_type)}
    for i, v in enumerate(recipe.variants):  # one label, one head: a head like its trunk named as another's type
        label, spec = recipe.head_label(v), _head_spec(recipe, v)
        key, other = made.setdefault(label, (f"variant[{i}]", spec))
        if other != spec:
            raise _err(
                path,
                f"variant[{i}]",
                f"its head ({_describe(spec)}) and {key}'s ({_describe(other)}) would "
                f"both be {naming.head_file(recipe.name, label)}; rename the variant",
            )
    pairs = {
        recipe.reference_type.upper(): (
            naming.model_file(recipe.name, recipe.reference_type.upper()),
            naming.head_file(recipe.name, recipe.head_label(None)),
        )
    }
    for v in recipe.variants:
        pairs[v.name] = (naming.model_file(recipe.name, v.name), naming.head_file(recipe.name, recipe.head_label(v)))
    files = sorted({f for pair in pairs.values() for f in pair})
    if recipe.layout == "both":
        files += [naming.combined_file(recipe.name, tag, "both") for tag in pairs]
    for tag, (model, _) in pairs.items():
        if model.startswith(naming.HEAD_PREFIX) or not naming.is_model(model):
            raise _err(
                path,
                "model.name",
                f"{recipe.name!r} makes {model}, which llama.cpp never takes as a model "
                f"(it skips file names holding {', '.join(naming.NOT_MODELS)})",
            )
    problems = naming.resolution_problems(files, pairs)
    if problems:
        where = next(
            (f"variant[{i}]" for i, v in enumerate(recipe.variants) if f"REPO:{v.name} " in problems[0]), "model.layout"
        )
        raise _err(
            path,
            where,
            f"{problems[0]} (llama.cpp pairs a tag with the head named -TAG., else with the "
            'nearest bits); give these quants one head type, or use layout = "combined"',
        )


def _head_spec(recipe: Recipe, v: Variant) -> str:
    """What decides a variant's head file: its type(s) (``keep``: the reference's), or its own quant (``same``)."""
    if v.head_like_trunk:
        return f"same as {v.name}"
    main = recipe.reference_type if v.mtp_type.is_keep else str(v.mtp_type)
    experts = v.mtp_experts_type
    exps = None if experts is None else recipe.reference_type if experts.is_keep else str(experts)
    return main + (f", experts {exps}" if exps is not None and exps != main else "")


def _describe(spec: str) -> str:
    return spec if spec.startswith("same") else f"mtp_type {spec}"
