"""The Typer app. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import typer

from .. import __version__

app = typer.Typer(
    name="mtpq",
    help=(
        "Convert, quantize and check LLMs that carry Multi-Token-Prediction (MTP) heads.\n\n"
        "Typical flow:\n\n"
        "  mtpq convert ./GLM-4.5-Air air-bf16.gguf                 # keeps the MTP head\n\n"
        "  mtpq quantize air-bf16.gguf air-q4km.gguf Q4_K_M          # trunk 4-bit, head held at q8_0\n\n"
        "  mtpq accept air-q4km.gguf --reference air-bf16.gguf --max-drop 0.05   # does the head still draft?\n\n"
        "  mtpq inspect air-q4km.gguf\n\n"
        "Try it on the bundled demo model: mtpq demo\n\n"
        "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtpq {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version.")):
    """mtpq: GGUF files whose MTP heads survive quantization."""


def main() -> None:
    app()


# Command modules register themselves on `app` when imported; --help lists them in this order.
from . import convert as _convert  # noqa: E402,F401
from . import quantize as _quantize  # noqa: E402,F401
from . import inspect as _inspect  # noqa: E402,F401
from . import surgery as _surgery  # noqa: E402,F401
from . import accept as _accept  # noqa: E402,F401
from . import sweep as _sweep  # noqa: E402,F401
from . import build as _build  # noqa: E402,F401
from . import demo as _demo  # noqa: E402,F401
