"""The i-quant grids, from gguf-py's dequantizer tables: lattice-point -> grid-index maps and the
neighbour lists, as ``iq2xs_init_impl`` / ``iq3xs_init_impl`` build them; the shared constants."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants as gq

from ..legacy import f32


QK_K = 256
_F32 = torch.float32
T = GGMLQuantizationType

# types whose ggml quantizer aborts without importance weights
REQUIRES_WEIGHTS = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ1_S})

GROUP_MAX_EPS = f32(1e-15)
GROUP_MAX_EPS_IQ3_XXS = f32(1e-8)


class _Grid:
    """One type's grid as the quantizer sees it (``iq2xs_init_impl`` / ``iq3xs_init_impl``).

    ``levels`` (n_grid, gw) int: the lattice coordinate l of each grid value
    (the quantizer's value is 2*l+1); ``kmap`` (bits**gw,) int64: grid index of
    a lattice point ``u = sum l_i << bits*i`` or -1; ``nb`` (bits**gw, M) int64:
    the neighbour list of an off-grid point, padded with -1.
    """

    def __init__(self, qcls, bits: int, nwant: int):
        qcls.init_grid()
        g = np.asarray(qcls.grid, dtype=np.float32).reshape(qcls.grid_shape)
        gmap = np.asarray(qcls.grid_map, dtype=np.float32)
        levels = np.argmax(g[..., None] == gmap, axis=-1)  # grid value -> its index in grid_map
        assert np.all(gmap[levels] == g)
        self.gw = g.shape[1]
        self.bits = bits
        self.levels = levels.astype(np.int64)
        self.values = (2 * self.levels + 1).astype(np.int64)  # kgrid_q2xs / kgrid_q3xs bytes
        shifts = bits * np.arange(self.gw)
        kmap_size = 1 << (bits * self.gw)
        kmap = np.full(kmap_size, -1, dtype=np.int64)
        kmap[(self.levels << shifts).sum(axis=1)] = np.arange(len(g))
        self.kmap = kmap
        self.shifts = shifts
        self._nwant = nwant
        self._nb_cache: dict[int, np.ndarray] = {}

    def neighbours(self, max_level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Neighbour lists of the off-grid points with all l <= max_level, as CSR.

        Returns (start, count, flat): the list of lattice point u is
        ``flat[start[u]:start[u] + count[u]]`` (count 0 for points not reached).
        """
        if max_level in self._nb_cache:
            return self._nb_cache[max_level]
        n_lv = max_level + 1
        pts = np.stack(np.meshgrid(*[np.arange(n_lv)] * self.gw, indexing="ij"), -1).reshape(-1, self.gw)
        u = (pts << self.shifts).sum(axis=1)
        off = self.kmap[u] < 0
        pts, u = pts[off], u[off]
        pos = (2 * pts + 1).astype(np.float32)
        vals = self.values.astype(np.float32)
        ng = len(vals)
        # squared integer distances to every grid point, by a (exact: small integers) matmul
        d2 = ((vals * vals).sum(1)[None, :] - 2 * (pos @ vals.T) + (pos * pos).sum(1)[:, None]).astype(np.int64)
        # the nwant-th smallest distinct distance of each point, from a presence table of distances
        present = np.zeros((len(u), int(d2.max()) + 1), dtype=bool)
        present[np.arange(len(u))[:, None], d2] = True
        thr = np.argmax(np.cumsum(present, axis=1) >= self._nwant, axis=1)
        # the kept grid points, per point ordered by (distance, index) as ggml's qsort leaves them
        rows, cols = np.nonzero(d2 <= thr[:, None])
        key = (rows * (d2.max() + 1) + d2[rows, cols]) * ng + cols
        o = np.argsort(key, kind="stable")
        rows, cols = rows[o], cols[o]
        cnt = np.bincount(rows, minlength=len(u))
        start = np.zeros(len(self.kmap), dtype=np.int64)
        count = np.zeros(len(self.kmap), dtype=np.int64)
        count[u] = cnt
        start[u] = np.cumsum(cnt) - cnt
        flat = cols
        self._nb_cache[max_level] = (start, count, flat.astype(np.int64))
        return self._nb_cache[max_level]


@functools.cache
def _grid(qtype: GGMLQuantizationType) -> _Grid:
    if qtype == T.IQ2_XXS:
        return _Grid(gq.IQ2_XXS, 2, 2)
    # (bits per lattice coordinate, nwant) as in iq2xs_init_impl / iq3xs_init_impl
    if qtype in (T.IQ1_S, T.IQ1_M):  # one grid for both
        return _Grid(gq.IQ1_S, 2, 3)
    bits, nwant = {T.IQ2_XS: (2, 2), T.IQ2_S: (2, 1), T.IQ3_XXS: (3, 2), T.IQ3_S: (3, 3)}[qtype]
    return _Grid(getattr(gq, qtype.name), bits, nwant)


@functools.cache
def _device_tables(qtype: GGMLQuantizationType, max_level: int, device: str):
    g = _grid(qtype)
    nb = tuple(torch.from_numpy(a).to(device) for a in g.neighbours(max_level))
    return (
        torch.from_numpy(g.kmap).to(device),
        nb,
        torch.from_numpy(g.values.astype(np.float32)).to(device),
        torch.from_numpy(g.levels).to(device),
        torch.from_numpy(g.shifts).to(device),
        # per CSR entry (a grid point), gofs[i] = i*n_lv + l_i: its table offset for coordinate i
        torch.from_numpy((np.arange(g.gw)[:, None] * (max_level + 1) + g.levels[g.neighbours(max_level)[2]].T)
                         .astype(np.int32)).to(device),
    )


_MAX_LEVEL = {T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 2, T.IQ3_XXS: 7, T.IQ3_S: 7, T.IQ1_S: 2, T.IQ1_M: 2}


def prepare(qtype: GGMLQuantizationType, device: str = "cpu") -> None:
    """Build the type's grid tables now (0.3-3 s, like ggml_quantize_init), e.g. before
    forking workers, which would otherwise each build their own."""
    if qtype in _MAX_LEVEL:
        _device_tables(GGMLQuantizationType(qtype), _MAX_LEVEL[qtype], device)
