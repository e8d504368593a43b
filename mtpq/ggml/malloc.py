"""The process-wide memory-allocation policy every long-running part of mtpq asks for."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

MMAP_THRESHOLD = 32 << 20  # blocks from this size up are mmapped and returned to the kernel when freed


@functools.cache
def keep_freed_buffers() -> None:
    """Have glibc keep freed temporaries for reuse (once per process): the quantization kernels' chunks,
    the converter's slabs and the runtime's long passes.

    Every chunk allocates and frees the same few 0.25-4 MB buffers.  With
    glibc's default policy (mmap above a threshold that only grows when an
    mmapped block is freed; trim the heap top above twice that) they go back to
    the kernel and are faulted in again, page by page, at the next chunk (what
    that costs: docs/notes/quantize.md).  Fixing the mmap threshold at 32 MB -- the ceiling of glibc's own dynamic
    threshold -- and trimming only above 128 MB keeps them.  Larger blocks
    (whole tensors) are still mmapped and returned.  A no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, MMAP_THRESHOLD)
    mallopt(m_trim_threshold, 128 << 20)
