"""The i-quants' grids, as ``iq2xs_init_impl`` / ``iq3xs_init_impl`` (``ggml_quantize_init``) build them.

The grid points come from gguf-py's dequantization tables (``gguf.quants``): each point's coordinate levels l
(its index in the class's ``grid_map``) give the quantizer's values 2l + 1, the map from a lattice point (its
levels packed ``bits`` per coordinate) to its grid index, and, for a lattice point off the grid, the list of
grid points at its ``nwant`` smallest squared distances, ordered by distance then index (ggml's qsort of
(distance, index) pairs). Lists are built for the lattice points the quantizers can reach (levels up to
``max_level``), in ggml's layout: ``kmap[u] = -(offset + 1)`` and ``neighbours[offset]`` the list's length.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import zipfile

import numpy as np
from gguf import quants as gq

from . import jit
from .jit import F, kernel

# family name: (gguf-py class, bits per coordinate, coordinates, nwant, highest level a quantizer reaches)
_FAMILIES = {
    "IQ2_XXS": (gq.IQ2_XXS, 2, 8, 2, 2),
    "IQ2_XS": (gq.IQ2_XS, 2, 8, 2, 2),
    "IQ2_S": (gq.IQ2_S, 2, 8, 1, 2),
    "IQ1_S": (gq.IQ1_S, 2, 8, 3, 2),  # IQ1_M shares it
    "IQ3_XXS": (gq.IQ3_XXS, 3, 4, 2, 7),
    "IQ3_S": (gq.IQ3_S, 3, 4, 3, 7),
}


@kernel
def _neighbour_lists(pos, bits, max_level, nwant, kmap):
    """Fill ``kmap`` for the reachable off-grid lattice points and return their neighbour lists."""
    ngrid, gw = pos.shape
    n_lv = max_level + 1
    count = n_lv**gw
    out = np.empty(count * (ngrid + 1), np.uint16)
    at = 0
    d2 = np.empty(ngrid, np.int64)
    seen = np.zeros(2048, np.bool_)
    for c in range(count):
        u = 0
        rest = c
        for k in range(gw):
            u |= (rest % n_lv) << (bits * k)
            rest //= n_lv
        if kmap[u] >= 0:
            continue
        seen[:] = False
        for j in range(ngrid):
            s = 0
            for k in range(gw):
                diff = np.int64(pos[j, k]) - (2 * ((u >> (bits * k)) & ((1 << bits) - 1)) + 1)
                s += diff * diff
            d2[j] = s
            seen[s] = True
        kmap[u] = -(at + 1)
        start = at
        at += 1
        nhave = 0
        for v in range(2048):
            if not seen[v]:
                continue
            for j in range(ngrid):
                if d2[j] == v:
                    out[at] = j
                    at += 1
            nhave += 1
            if nhave == nwant:
                break
        out[start] = at - start - 1
    return out[:at].copy()


@functools.cache
def grid_tables(family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pos int8 (n_grid, coordinates) of 2l + 1, kmap int32, neighbours uint16) of a grid family."""
    qcls, bits, gw, nwant, max_level = _FAMILIES[family]
    g, gmap = dequant_grid(family), np.asarray(qcls.grid_map, dtype=np.float32)
    levels = np.argmax(g[..., None] == gmap, axis=-1).astype(np.int64)
    pos = (2 * levels + 1).astype(np.int8)
    keys = (levels << (bits * np.arange(gw))).sum(axis=1)
    # the lists cost a command 0.02-0.1 s (IQ1's 2048 points), and loading their kernel: they are kept beside the
    # kernels, in the folder named by these sources' hash, and taken back only whole (the zip's CRC) and fitting
    path = os.path.join(jit.CACHE_DIR, f"grid-{family}.npz")
    try:
        with np.load(path) as stored:
            kmap, neighbours = stored["kmap"], stored["neighbours"]
        if kmap.dtype == np.int32 and kmap.shape == (1 << (bits * gw),) and neighbours.dtype == np.uint16:
            if np.array_equal(kmap[keys], np.arange(len(g))) and kmap.min() >= -len(neighbours):
                return pos, kmap, neighbours
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # missing, cut short, not ours
        pass
    kmap = np.full(1 << (bits * gw), -1, dtype=np.int32)
    kmap[keys] = np.arange(len(g), dtype=np.int32)
    neighbours = _neighbour_lists(pos, bits, max_level, nwant, kmap)
    with contextlib.suppress(OSError):  # a folder this user cannot write costs the next command the build
        os.makedirs(jit.CACHE_DIR, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=jit.CACHE_DIR, prefix=f".grid-{family}-", suffix=".npz")
        try:  # written whole under a temporary name, then renamed
            with os.fdopen(fd, "wb") as f:
                np.savez(f, kmap=kmap, neighbours=neighbours)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return pos, kmap, neighbours


@functools.cache
def search_tables(family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the quantizers search with: (grid points' values 2l + 1 as float32 (IQ1: l - 1 + 0.125, then
    l - 1 - 0.125), their levels l as int8, both flat: point g at ``[coordinates*g:]``; kmap; neighbours). The
    values are float once here, not at every candidate of a neighbour search."""
    pos, kmap, neighbours = grid_tables(family)
    levels = ((pos - 1) // 2).astype(np.int8).ravel()
    values = pos.astype(np.float32).ravel()
    if family == "IQ1_S":  # IQ1's values are l - 1 shifted by +-IQ1S_DELTA (0.125): up, then down
        values = np.concatenate([levels - F(1.0) + F(0.125), levels - F(1.0) - F(0.125)]).astype(np.float32)
    return values, levels, kmap, neighbours


@functools.cache
def dequant_grid(family: str) -> np.ndarray:
    """The grid's dequantized values (ggml's ``iq2xxs_grid`` ... bytes), float32 (n_grid, coordinates)."""
    qcls = _FAMILIES[family][0]
    qcls.init_grid()
    return np.ascontiguousarray(np.asarray(qcls.grid, dtype=np.float32).reshape(-1, _FAMILIES[family][2]))


KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # ksigns_iq2xs: 7 sign bits and their parity
