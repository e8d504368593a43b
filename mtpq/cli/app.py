"""The Typer app. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors  # typer vendors its own click
from typer.core import TyperGroup

from .. import __version__


class OneLineErrors(TyperGroup):
    """click's usage errors as one line plus where to look (not a five-line panel); ``--debug`` anywhere."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from .common import DEBUG, EXIT_SIGINT, console

        args = list(sys.argv[1:] if args is None else args)
        if "--debug" in args[: args.index("--") if "--" in args else len(args)]:
            DEBUG["on"] = True
            args.remove("--debug")
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            exc.show()  # `mtpq` or `mtpq convert` alone: the help is the answer
            sys.exit(exc.exit_code)
        except click_errors.UsageError as exc:
            names = []
            ctx = exc.ctx
            while ctx is not None and ctx.parent is not None:
                names.append(ctx.info_name)
                ctx = ctx.parent
            cmd = " ".join(["mtpq", *reversed(names)])
            console.print(
                f"error: {' '.join(exc.format_message().split()).rstrip('.')}; try '{cmd} --help'",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            console.print(
                f"error: {' '.join(exc.format_message().split())}", markup=False, highlight=False, soft_wrap=True
            )
            sys.exit(exc.exit_code)
        except typer.Abort:
            console.print("interrupted", markup=False)
            sys.exit(EXIT_SIGINT)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    name="mtpq",
    help=(
        "Convert, quantize and check LLMs that carry Multi-Token-Prediction (MTP) heads.\n\n"
        "Typical flow:\n\n"
        "  mtpq convert ./GLM-4.5-Air air-bf16.gguf                 # keeps the MTP head\n\n"
        "  mtpq quantize air-bf16.gguf air-q4km.gguf Q4_K_M          # trunk 4-bit, head held at q8_0\n\n"
        "  mtpq accept air-q4km.gguf --reference air-bf16.gguf --max-drop 0.05   # does the head still draft?\n\n"
        "  mtpq inspect air-q4km.gguf\n\n"
        "Try it on the bundled demo model: mtpq demo\n\n"
        "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input, 3 internal error (a bug: please report it "
        "with the traceback --debug prints), 130/143 interrupted (Ctrl-C / SIGTERM)."
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
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(
        False, "--debug", help="Print the traceback of an internal error (accepted anywhere on the command line)."
    ),
):
    """mtpq: GGUF files whose MTP heads survive quantization."""
    if debug:
        from .common import DEBUG

        DEBUG["on"] = True


def main() -> None:
    app()
