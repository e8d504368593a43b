"""Engines other than the bundled torch runtime that can measure acceptance (llama.cpp's llama-server)."""
