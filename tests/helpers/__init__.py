"""What the tests share: running the CLI in-process, reading GGUFs, llama.cpp's converter and binaries as
references, the per-family cross-checks."""
