"""ggml's tensor formats, byte for byte: the quantizers and dequantizers llama.cpp's ``ggml-quants.c`` runs.

One module per type family, each reproducing the reference C code's float rules (see :mod:`.cfloat`):

- :mod:`.legacy`   Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, and the scalar helpers the others share
- :mod:`.kquants`  Q2_K..Q6_K without an importance matrix; :mod:`.search` their scale searches (torch, for
  other devices than the CPU); :mod:`.npkquants` both in numpy, which runs them on CPU
- :mod:`.weighted` the importance-weighted k-quant and IQ4 paths (llama-quantize ``--imatrix``)
- :mod:`.iquants`  IQ1_*/IQ2_*/IQ3_* (grids, lattice search, dequant); :mod:`.iq4` IQ4_NL/IQ4_XS
- :mod:`.mxfp4`    MXFP4 blocks (moved bit for bit from checkpoints that ship them)
- :mod:`.vecops`   the vectorised row operations the torch searches share; :mod:`.cnumpy` the C float rules
  in numpy
- :mod:`.kernels`  the registry: ``quantize``/``dequantize`` for every supported type, chunked and parallel
- :mod:`.types`    which types mtpq writes; :mod:`.malloc` the process-wide allocation policy
- :mod:`.npquant`  Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 in numpy alone, and the entry to :mod:`.npkquants` (no torch);
  :mod:`.pool` workers forked once per output file;
  :mod:`.from_file` float tensors quantized by those workers straight from the file that stores them

Nothing here imports the rest of mtpq: the formats do not know about models, presets or files.
"""
