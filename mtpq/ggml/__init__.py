"""ggml's tensor formats, byte for byte: the quantizers and dequantizers of llama.cpp's ``ggml-quants.c``,
written once each as its loops and compiled with numba (:mod:`.jit`).

- :mod:`.engine`    the one way in: ``quantize`` (an array, or :class:`~.engine.Stored` values of a file) and
  ``dequantize``, for every type; threads share a tensor's chunks
- :mod:`.registry`  one record per type: block, bytes, quantize, quantize with importance, dequantize
- :mod:`.legacy`    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q1_0/Q2_0; :mod:`.kquants` Q2_K..Q6_K and the scale searches;
  :mod:`.iq4` IQ4_NL/IQ4_XS; :mod:`.iquants` IQ1_*/IQ2_*/IQ3_* on the grids of :mod:`.iqtables`;
  :mod:`.ternary` TQ1_0/TQ2_0; :mod:`.mxfp4` MXFP4; :mod:`.floats` F16/BF16 and the checks every type makes
- :mod:`.jit`       numba's settings and C's float32 rules (fp16, ``nearest_int``, casts)
- :mod:`.types`     gguf-py's type enums completed (Q2_0); :mod:`.malloc` the process's allocation policy

Nothing here imports the rest of mtpq, nor torch: the formats do not know about models, presets or files.
"""
