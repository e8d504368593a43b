"""Engines other than the bundled torch runtime that can measure acceptance (llama.cpp's llama-server)."""

ENGINES = ("torch", "llama.cpp")  # what --engine and a release gate's engine choose from
