"""The tiny checkpoint builders: each writes a Hugging Face folder shaped like a release (its config keys
and every tensor name, MTP layers included), with random weights."""
