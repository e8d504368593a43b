"""``python -m mtpq``: the same command line as ``mtpq``."""

from .cli import main

main()
