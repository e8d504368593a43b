"""``mtpq build``: reproducible, gated CI artifact builds from a TOML recipe."""

from .recipe import Recipe, load_recipe
from .runner import run_build, write_outputs

__all__ = ["Recipe", "load_recipe", "run_build", "write_outputs"]
