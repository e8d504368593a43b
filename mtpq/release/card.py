"""The model card (README.md) a Hub page renders, from a build's manifest alone.

YAML front matter the Hub reads (``base_model``, ``base_model_relation: quantized``, ``tags``, ``quantized_by``,
``license`` from the recipe's [publish] table); a table with a row per quant (the trunk and the head file
``llama-server -hf REPO:TAG --spec-type draft-mtp`` fetches together, their size, the trunk's quality against
the reference and the head's acceptance and drop), a table with a row per file, and the llama.cpp command lines
that use them. A ``-hf`` line is shown only where llama.cpp's own selection (mirrored in :mod:`.layout`) picks
exactly the files named beside it.
"""

from __future__ import annotations

from pathlib import Path

from . import layout as naming
from .bookkeeping import files_of

PLACEHOLDER_REPO = "OWNER/NAME"


def _front_matter(manifest: dict) -> list[str]:
    pub = manifest.get("publish") or {}
    lines = ["---"]
    if pub.get("base_model"):
        lines += ["base_model:", f"- {pub['base_model']}", "base_model_relation: quantized"]
    if pub.get("license"):
        lines.append(f"license: {pub['license']}")
    lines += [
        "library_name: gguf",
        "pipeline_tag: text-generation",
        "tags:",
        "- gguf",
        "- mtp",
        "- speculative-decoding",
    ]
    if pub.get("quantized_by"):
        lines.append(f"quantized_by: {_yaml_str(pub['quantized_by'])}")
    return lines + ["---", ""]


def _yaml_str(text: str) -> str:
    """A YAML scalar: quoted when plain style would read it as something else."""
    plain = (
        text
        and text.strip() == text
        and not any(c in text for c in ":#'\"[]{},&*!|>%@`")
        and text.lower() not in ("yes", "no", "true", "false", "null", "on", "off", "~")
    )
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _size_text(n: int | None) -> str:
    if not n:
        return "the shard size"
    for unit, scale in (("G", 1000**3), ("M", 1000**2)):
        if n % scale == 0:
            return f"{n // scale} {unit}B"
    return f"{n:,} bytes"


def _file_name(e: dict) -> str:
    more = f" + {len(e['shards']) - 1} more shards" if "shards" in e else ""
    return f"`{e['file']}`{more}"


def _rows(manifest: dict) -> list[dict]:
    """One per -hf tag: the reference first, then the variants; the entry a user fetches by the tag (the trunk
    in the layouts with head files), its head file's entry, and the fused one-file entry (layout "both")."""
    files = manifest["files"]
    heads = {e["file"]: e for e in files if e["kind"] == "head"}
    rows = []
    for e in files:
        fused_copy = e.get("form") == "combined" and manifest["layout"] != "combined"
        if e["kind"] not in ("reference", "variant") or fused_copy:
            continue
        fused = next(
            (f for f in files if f.get("form") == "combined" and f.get("tag") == e.get("tag") and f is not e), None
        )
        rows.append(
            {
                "tag": e.get("tag") or e.get("variant") or e["preset"],
                "main": e,
                "head": heads.get(e.get("head")),
                "fused": fused,
            }
        )
    return rows


def model_card(manifest: dict, repo: str | None = None) -> str:
    repo = repo or (manifest.get("publish") or {}).get("repo") or PLACEHOLDER_REPO
    gate = manifest.get("gate")
    name, sidecar = manifest["model"], manifest.get("layout", "combined") != "combined"
    lines = _front_matter(manifest)
    lines += [
        f"# {name} — GGUF with MTP heads",
        "",
        f"Built by {manifest['tool']} from `{manifest['source']['folder']}` (recipe sha256 "
        f"`{manifest['recipe_sha256'][:12]}`). Every quant keeps the model's Multi-Token-Prediction head, so "
        "llama.cpp can self-draft with `--spec-type draft-mtp`.",
    ]
    if sidecar:
        lines += [
            "",
            "Each quant is a trunk-only file and a head file (`mtp-*.gguf`) shared by the quants with the "
            "same head type: `llama-server -hf REPO:TAG --spec-type draft-mtp` fetches the two together, and "
            "llama.cpp picks each quant's head by the file names (the head named for the tag, else the nearest "
            "bits)."
            + (
                " The `*_MTP.gguf` files hold trunk and head in one file, for tools that take one."
                if manifest["layout"] == "both"
                else ""
            ),
        ]
    lines.append("")
    if gate:
        lines += [
            f"Acceptance: greedy draft acceptance rate at depth k={gate['draft']} on the "
            f"`{Path(gate['prompts']).name}` prompts ({gate['max_new_tokens']} new tokens each), measured by "
            f"`mtpq accept` ({gate.get('engine', 'torch')} engine) on each quant as llama.cpp loads it"
            + (" (the trunk with its head file)" if sidecar else "")
            + "; drop: below the reference's.",
            "",
        ]
    quality = bool(gate and gate.get("text"))
    if quality:
        lines += [
            f"Quality: the trunk against the reference on `{Path(gate['text']).name}` as llama-perplexity "
            f"--kl-divergence measures it (chunks of {gate['kld_ctx_size']} tokens): mean KLD, how often the "
            "top token agrees, PPL ratio; computed by `mtpq compare`.",
            "",
        ]
    lines += _quant_table(manifest, quality)
    lines += ["", "## Files", "", "| file | size | bits/weight | holds | acceptance |", "|---|---:|---:|---|---:|"]
    for e in manifest["files"]:
        lines.append(
            f"| {_file_name(e)} | {_mib(e['bytes'])} | {e['bits_per_weight']:.2f} | {_holds(e)} | "
            f"{_pct(e.get('acceptance', {}).get('acceptance_rate'))} |"
        )
    lines += ["", "## Use with llama.cpp", ""] + _commands(manifest, repo)
    split = [f for f in manifest["files"] if "shards" in f]
    if split:
        first = split[0]
        lines += [
            "",
            f"Files over {_size_text(first.get('split_max_size'))} are split (`NAME-00001-of-0000N.gguf`, "
            "...). Download every shard of a quant into one folder and give llama.cpp the first: "
            f"`llama-server -m {first['file']} --spec-type draft-mtp` loads them all.",
        ]
    lines += [
        "",
        "Check the downloads with `sha256sum -c SHA256SUMS`; check any MTP GGUF with `mtpq inspect --check FILE...`.",
        "",
    ]
    return "\n".join(lines)


def _quant_table(manifest: dict, quality: bool) -> list[str]:
    ref = next((e for e in manifest["files"] if e["kind"] == "reference"), None)
    ref_rate = (ref or {}).get("acceptance", {}).get("acceptance_rate")
    head = "| quant | files | size | bits/weight | head | acceptance | drop |"
    rule = "|---|---|---:|---:|---|---:|---:|"
    if quality:
        head, rule = head + " mean KLD | same top | PPL ratio |", rule + "---:|---:|---:|"
    lines = ["## Quants", "", head + " gate |", rule + "---|"]
    for row in _rows(manifest):
        e, h = row["main"], row["head"]
        files = _file_name(e) + (f" + `{h['file']}`" if h else "")
        size = e["bytes"] + (h["bytes"] if h else 0)
        types = ", ".join((h or e).get("mtp_precision") or []) or "—"
        rate = e.get("acceptance", {}).get("acceptance_rate")
        drop = (
            "—"
            if rate is None or ref_rate is None or e["kind"] == "reference"
            else f"{100 * (ref_rate - rate):+.1f} pt"
        )
        q = e.get("quality") or {}
        cells = ""
        if quality:
            cells = f" {q['kld_mean']:.4f} | {100 * q['top1']:.1f} % | {q['ppl_ratio']:.4f} |" if q else " — | — | — |"
        g = e.get("gate")
        verdict = "—" if g is None else ("pass" if g["passed"] else "FAIL: " + g["reason"])
        lines.append(
            f"| {row['tag']} | {files} | {_mib(size)} | {e['bits_per_weight']:.2f} | {types} | "
            f"{_pct(rate)} | {drop} |{cells} {verdict} |"
        )
    return lines


def _holds(e: dict) -> str:
    if e["kind"] == "head":
        return f"head ({', '.join(e.get('mtp_precision') or [])}) for {', '.join(e.get('pairs') or []) or '—'}"
    if e["kind"] in ("mtp-only", "no-mtp"):
        return {"mtp-only": "the reference's head alone", "no-mtp": "the reference's trunk alone"}[e["kind"]]
    what = "trunk" if e.get("form") == "trunk" else "trunk + head"
    return f"{e.get('tag') or e.get('variant') or e['preset']}: {what}"


def _commands(manifest: dict, repo: str) -> list[str]:
    paths = [f["file"] for e in manifest["files"] for f in files_of(e)]
    lines = ["```sh"]
    for row in _rows(manifest):
        e, h, tag = row["main"], row["head"], row["tag"]
        lines.append(f"# {tag}")
        if naming.resolution_problems(paths, {tag: (e["file"], h["file"] if h else None)}) == [] and (
            h is not None or not naming.heads_for(paths, e["file"], tag)
        ):
            lines.append(f"llama-server -hf {repo}:{tag} --spec-type draft-mtp")
        if h is not None:
            lines.append(f"llama-server -m {e['file']} -md {h['file']} --spec-type draft-mtp")
        else:
            lines.append(f"llama-server -m {e['file']} --spec-type draft-mtp")
        if row["fused"] is not None:
            lines.append(f"llama-server -m {row['fused']['file']} --spec-type draft-mtp   # one file")
    return lines + ["```"]
