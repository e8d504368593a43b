"""GGUF in and out: models read whole (a file or every shard of a split set), plans streamed into a file or a
split set, atomically.

- :mod:`.files`: :func:`open_model` (one file or a whole split set, checked; torch-free, for the llama.cpp
  engines too);
- :mod:`.read`: :class:`GGUFFile` (metadata and tensors by name, for the runtime and ``inspect``),
  :func:`plan_from_gguf` (a plan that rewrites a model);
- :mod:`.write`: :func:`write_plan` (one file, or shards by a :class:`SplitRule`), atomic outputs and the clean-up
  of what killed runs left;
- :mod:`.buffers`: each tensor encoded and written as its rows are finished, memory near one tensor;
- :mod:`.summary`: :func:`~.summary.summarize_gguf`, what a model holds as JSON-ready data (``mtpq inspect``).

Both directions use gguf-py (GGUFReader, GGUFWriter); nothing here serializes GGUF by hand.
"""

from .buffers import encode_tensor, output_buffer, report_progress, tensor_nbytes
from .files import (
    SPLIT_KEYS,
    ModelFiles,
    first_shard,
    open_gguf,
    open_model,
    reader_arch,
    shard_name,
    shard_paths,
    split_prefix,
)
from .read import GGUFFile, plan_from_gguf, reader_kv
from .write import (
    SplitRule,
    atomic_output,
    atomic_outputs,
    check_not_an_input,
    output_paths,
    parse_size,
    partial_folder,
    refresh_size_label,
    remove_partial,
    remove_stale_partials,
    size_label,
    write_plan,
)

__all__ = [
    "SPLIT_KEYS",
    "GGUFFile",
    "ModelFiles",
    "SplitRule",
    "atomic_output",
    "atomic_outputs",
    "check_not_an_input",
    "encode_tensor",
    "first_shard",
    "open_gguf",
    "open_model",
    "output_buffer",
    "output_paths",
    "parse_size",
    "partial_folder",
    "plan_from_gguf",
    "reader_arch",
    "reader_kv",
    "refresh_size_label",
    "remove_partial",
    "remove_stale_partials",
    "report_progress",
    "shard_name",
    "shard_paths",
    "size_label",
    "split_prefix",
    "tensor_nbytes",
    "write_plan",
]
