"""mtpq: convert, quantize and check LLMs that carry Multi-Token-Prediction (MTP) heads.

The package has four parts, one folder each:

- ``mtpq.convert``  HF checkpoint -> stream of named tensors with GGUF names, roles, metadata
- ``mtpq.quantize`` ggml-exact quant kernels, the precision policy, GGUF -> GGUF
- ``mtpq.runtime``  torch models read straight from GGUF, MTP drafting, acceptance
- ``mtpq.cli``      the ``mtpq`` command line

Everything in between is a :class:`mtpq.tensors.Plan`: metadata plus a list of
lazily loaded :class:`mtpq.tensors.TensorSpec` that one writer streams to disk.
"""

__version__ = "0.1.0"
