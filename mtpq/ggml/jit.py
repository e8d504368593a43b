"""numba for the kernels, and C's float32 rules as numba functions every type family shares.

Every kernel is ``@kernel`` (``numba.njit(nogil=True, cache=True)``): compiled at its first call, the machine
code kept on disk, the GIL released while it runs (threads run kernels side by side). The float rules of
``ggml-quants.c`` as gcc builds it for x86-64 (libggml-base: no ``-march``, so no FMA and no contraction):

- float32 arithmetic, one rounding per operation in C's order: numba without ``fastmath`` neither fuses nor
  reorders; every constant is a float32 (``F(...)``) and ints are converted with ``F(i)`` where C converts;
- ``(int)f`` of a float out of int range or NaN is x86's ``cvttss2si``: INT_MIN (:func:`c_int`);
- ``nearest_int`` is ggml's bit trick on ``f + 12582912.f`` (:func:`nearest_int`);
- fp16 scales go through ggml's own software conversion, bit for bit (:func:`fp16`).

The compiled code is kept in the user's cache folder (``$XDG_CACHE_HOME/mtpq/numba``, or under
``NUMBA_CACHE_DIR``), in a folder named by a hash of this package's sources: numba checks only the file that
defines a kernel, and a kernel holds the helpers of other files compiled in, so any change here starts afresh.
A read-only install works the same way.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys
from numba.extending import intrinsic


def _cache_dir() -> str:
    sources = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        sources.update(f.name.encode() + f.read_bytes())
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mtpq", "numba"
    )
    return os.path.join(base, f"ggml-{sources.hexdigest()[:16]}")


CACHE_DIR = _cache_dir()
numba.config.CACHE_DIR = CACHE_DIR  # read by numba when a kernel is first called


class _KernelCache(FunctionCache):
    """numba's on-disk cache, less one step of its loader. Before loading anything numba "refreshes" its compiler
    context, which imports every lowering it has (strings, sets, dicts, random generators, polynomials): 0.1-0.3 s
    of every command's start-up, ~half of it. A cached kernel is linked machine code that needs none of them,
    only numba's runtime (NRT) for the kernels that allocate. A kernel that misses the cache is compiled, and
    numba's compiler refreshes the context itself first."""

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)  # once per process; what the refresh did first
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)


# the loader internals _KernelCache calls (as numba 0.68 has them); where a numba moved them, its own loader stays
_LIGHT_LOADER = all(hasattr(FunctionCache, a) for a in ("_guard_against_spurious_io_errors", "_load_overload"))


def _jit(**options):
    def decorate(fn):
        dispatcher = numba.njit(nogil=True, cache=True, error_model="numpy", **options)(fn)
        if _LIGHT_LOADER:
            dispatcher._cache = _KernelCache(fn)  # what Dispatcher.enable_caching() set, with the lighter loader
        return dispatcher

    return decorate


kernel = _jit()  # error_model="numpy": C division, x/0 is inf or NaN
# a helper numba copies into each caller before typing it: the caller's constants (a type's group width, bits,
# flags) reach its loops, which LLVM then unrolls and folds
inline = _jit(inline="always")
# a kernel without numba's reference counting: it allocates nothing, its caller hands it every array (scratch
# included), so the arrays its inlined helpers pass on cost no atomic increments and decrements in its loops
raw_kernel = _jit(_nrt=False)

F = np.float32
GROUP_MAX_EPS = F(1e-15)
QK_K = 256
_MAGIC = F(12582912.0)
_SCALE_TO_INF = F(2.0**112)
_SCALE_TO_ZERO = F(2.0**-110)
_INT_MAX_F = F(2147483648.0)


def bind(fn, *consts):
    """``fn`` with its last arguments fixed: one type's kernel where types share a loop. ``.kernel`` is ``fn``
    (what the engine asks numba about)."""

    def run(*args):
        return fn(*args, *consts)

    run.kernel = fn
    return run


@intrinsic
def f32_bits(typingctx, x):
    """The bits of a float32, as a uint32 (C's memcpy into an int)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """The float32 whose bits are the low 32 bits of the integer ``u``."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


@kernel
def nearest_int(f):
    """ggml's ``nearest_int``: the low mantissa bits of ``f + 12582912.f``."""
    return np.int32((f32_bits(f + _MAGIC) & np.uint32(0x007FFFFF))) - np.int32(0x00400000)


@kernel
def c_int(f):
    """C's ``(int)f`` as x86 computes it (truncation; INT_MIN for NaN and values out of range)."""
    if f >= -_INT_MAX_F and f < _INT_MAX_F:
        return np.int64(np.int32(f))
    return np.int64(-2147483648)


@kernel
def roundf(f):
    """C's ``roundf``: halves away from zero (``f - trunc(f)`` is exact)."""
    t = np.trunc(f)
    if abs(f - t) >= F(0.5):
        t += F(1.0) if f > 0 else F(-1.0)
    return t


@kernel
def i8(v):
    """A C int stored into ``int8_t`` (two's-complement wrap)."""
    return ((v + 128) & 0xFF) - 128


@kernel
def fp16(f):
    """``GGML_FP32_TO_FP16``: ggml's software conversion (round to nearest even; 0x7E00 for NaN), uint16."""
    base = (abs(f) * _SCALE_TO_INF) * _SCALE_TO_ZERO
    w = f32_bits(f)
    shl1_w = np.uint32(w + w)
    sign = w & np.uint32(0x80000000)
    bias = shl1_w & np.uint32(0xFF000000)
    if bias < np.uint32(0x71000000):
        bias = np.uint32(0x71000000)
    base = bits_f32(np.uint32((bias >> np.uint32(1)) + np.uint32(0x07800000))) + base
    bits = f32_bits(base)
    exp_bits = (bits >> np.uint32(13)) & np.uint32(0x00007C00)
    mantissa_bits = bits & np.uint32(0x00000FFF)
    nonsign = exp_bits + mantissa_bits
    if shl1_w > np.uint32(0xFF000000):
        nonsign = np.uint32(0x7E00)
    return np.uint16((sign >> np.uint32(16)) | nonsign)


@kernel
def fp16_to_f32(h):
    """``GGML_FP16_TO_FP32`` of the uint16 ``h`` (exact)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:
        if man == 0:
            return bits_f32(sign)
        e = np.uint32(113)  # a subnormal: normalise the mantissa
        while (man & np.uint32(0x400)) == 0:
            man <<= np.uint32(1)
            e -= np.uint32(1)
        return bits_f32(sign | (e << np.uint32(23)) | ((man & np.uint32(0x3FF)) << np.uint32(13)))
    if exp == 31:
        return bits_f32(sign | np.uint32(0x7F800000) | (man << np.uint32(13)))
    return bits_f32(sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13)))


@kernel
def absmax(x, at, n):
    """(largest |x|, the value that has it: the first found) over ``x[at:at+n]``; (0, 0) for all zeros."""
    amax = F(0.0)
    mx = F(0.0)
    for i in range(n):
        ax = abs(x[at + i])
        if ax > amax:
            amax = ax
            mx = x[at + i]
    return amax, mx


# The 32-value block scans of the legacy types, in 8-lane vectors. C's loops carry one compare chain through
# the block (``if (v < min) min = v``: a cycle or more per value, which neither gcc nor LLVM may reorder without
# fast-math); min, max and |x|'s max are the same values in any order, so lanes compare side by side and then
# with each other. A NaN is skipped, as C's compares skip it: it only ever stands where a compare reads it.
_F32X8 = ir.VectorType(ir.FloatType(), 8)
_I32X8 = ir.VectorType(ir.IntType(32), 8)
_FLT_MAX_F = float(F(3.4028234663852886e38))


def _block_lanes(context, builder, arrty, arr, at):
    """x[at:at+32] of a C-contiguous float32 array as four <8 x float> loads."""
    data = context.make_array(arrty)(context, builder, arr).data
    vectors = builder.bitcast(builder.gep(data, [at]), _F32X8.as_pointer())
    return [builder.load(builder.gep(vectors, [ir.Constant(ir.IntType(64), k)]), align=4) for k in range(4)]


def _keep(builder, op, a, b):
    """``a`` where ``a op b`` holds, else ``b`` (C's ``if (a op b) b = a``; b a NaN never)."""
    return builder.select(builder.fcmp_ordered(op, a, b), a, b)


def _across(builder, op, v):
    """The 8 lanes of ``v`` to the one ``op`` keeps: halves against halves."""
    for width in (4, 2, 1):
        lanes = ir.VectorType(ir.IntType(32), width)
        low = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width))))
        high = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width, 2 * width))))
        v = _keep(builder, op, high, low)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _a_block(x, at) -> bool:
    """Whether the arguments are a 1-D C-contiguous float32 array and an integer offset (the caller keeps
    ``at + 32`` within the array: the loads are not bounds-checked)."""
    f32_row = isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"
    return f32_row and isinstance(at, types.Integer)


@intrinsic
def block_min_max(typingctx, x, at):
    """(min, max) of ``x[at:at+32]`` as C's loop from FLT_MAX / -FLT_MAX finds them, but for the sign of a zero:
    where one of them is 0, C's loop keeps the first zero it met, which the caller asks that loop for."""
    if not _a_block(x, at):
        return None
    sig = types.UniTuple(types.float32, 2)(x, at)

    def codegen(context, builder, signature, args):
        at64 = context.cast(builder, args[1], signature.args[1], types.int64)
        low, high = ir.Constant(_F32X8, [_FLT_MAX_F] * 8), ir.Constant(_F32X8, [-_FLT_MAX_F] * 8)
        for v in _block_lanes(context, builder, signature.args[0], args[0], at64):
            low, high = _keep(builder, "<", v, low), _keep(builder, ">", v, high)
        return context.make_tuple(builder, sig.return_type, [_across(builder, "<", low), _across(builder, ">", high)])

    return sig, codegen


@intrinsic
def block_absmax(typingctx, x, at):
    """:func:`absmax` of ``x[at:at+32]``: the largest |x| and the first value that has it; (0, 0) for zeros."""
    if not _a_block(x, at):
        return None
    sig = types.UniTuple(types.float32, 2)(x, at)

    def codegen(context, builder, signature, args):
        at64 = context.cast(builder, args[1], signature.args[1], types.int64)
        no_sign = ir.Constant(_I32X8, [0x7FFFFFFF] * 8)
        mags = [
            builder.bitcast(builder.and_(builder.bitcast(v, _I32X8), no_sign), _F32X8)
            for v in _block_lanes(context, builder, signature.args[0], args[0], at64)
        ]
        amax = ir.Constant(_F32X8, [0.0] * 8)
        for a in mags:
            amax = _keep(builder, ">", a, amax)
        amax = _across(builder, ">", amax)
        # where it first stands: a bit per value whose |x| equals it, the lowest set bit
        i32 = ir.IntType(32)
        every = builder.insert_element(ir.Constant(_F32X8, ir.Undefined), amax, ir.Constant(i32, 0))
        every = builder.shuffle_vector(every, every, ir.Constant(_I32X8, [0] * 8))
        found = ir.Constant(i32, 0)
        for k, a in enumerate(mags):
            bits = builder.zext(builder.bitcast(builder.fcmp_ordered("==", a, every), ir.IntType(8)), i32)
            found = builder.or_(found, builder.shl(bits, ir.Constant(i32, 8 * k)))
        cttz = builder.module.declare_intrinsic("llvm.cttz", [i32, ir.IntType(1)])
        first = builder.and_(builder.call(cttz, [found, ir.Constant(ir.IntType(1), 0)]), ir.Constant(i32, 31))
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        value = builder.load(builder.gep(data, [builder.add(at64, builder.zext(first, ir.IntType(64)))]))
        zero = ir.Constant(ir.FloatType(), 0.0)
        value = builder.select(builder.fcmp_ordered("==", amax, zero), zero, value)  # C's loop never moved
        return context.make_tuple(builder, sig.return_type, [amax, value])

    return sig, codegen


@kernel
def put_fp16(y, at, f):
    """Store ``f`` as fp16 at byte ``at`` of ``y`` (little-endian); returns the uint16."""
    h = fp16(f)
    y[at] = np.uint8(h & np.uint16(0xFF))
    y[at + 1] = np.uint8(h >> np.uint16(8))
    return h


@kernel
def get_fp16(y, at):
    """The fp16 at byte ``at`` of ``y`` as float32."""
    return fp16_to_f32(np.uint16(y[at]) | (np.uint16(y[at + 1]) << np.uint16(8)))


@kernel
def put_u32(y, at, v):
    for k in range(4):
        y[at + k] = np.uint8((v >> (8 * k)) & 0xFF)


@kernel
def get_u32(y, at):
    return (
        np.uint32(y[at])
        | (np.uint32(y[at + 1]) << np.uint32(8))
        | (np.uint32(y[at + 2]) << np.uint32(16))
        | (np.uint32(y[at + 3]) << np.uint32(24))
    )


@kernel
def get_u16(y, at):
    return np.uint32(y[at]) | (np.uint32(y[at + 1]) << np.uint32(8))
