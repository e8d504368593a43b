// qharness TYPE ROWS N_PER_ROW IN.f32 IMATRIX.f32|- OUT.bin
//
// ggml_quantize_chunk(TYPE, in, out, 0, ROWS, N_PER_ROW, imatrix) of llama.cpp's ggml, the call llama-quantize makes
// for one 2-D tensor (with --imatrix: the importance weights, one per column). Public ggml API only. Used by
// tests/golden/make_golden_quants.py to (re)make tests/data/golden_quants/*.npz and by the llama_cpp-marked fuzz
// tests; build it against a llama.cpp build:
//   gcc -O2 -o qharness qharness.c -I $LLAMA/ggml/include -L $LLAMA/build/bin -lggml-base -Wl,-rpath,$LLAMA/build/bin
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: qharness TYPE ROWS N_PER_ROW IN.f32 IMATRIX.f32|- OUT.bin\n");
        return 2;
    }
    int type = atoi(argv[1]);
    long rows = atol(argv[2]), n = atol(argv[3]);
    float *x = malloc(rows * n * sizeof(float)), *w = NULL;
    FILE *f = fopen(argv[4], "rb");
    if (!f || fread(x, sizeof(float), rows * n, f) != (size_t)(rows * n)) return 3;
    fclose(f);
    if (argv[5][0] != '-') {
        w = malloc(n * sizeof(float));
        f = fopen(argv[5], "rb");
        if (!f || fread(w, sizeof(float), n, f) != (size_t)n) return 4;
        fclose(f);
    }
    size_t size = ggml_row_size(type, n) * rows;
    void *out = malloc(size);
    ggml_quantize_init(type);  // the i-quants' grids
    if (ggml_quantize_chunk(type, x, out, 0, rows, n, w) != size) return 5;
    f = fopen(argv[6], "wb");
    if (!f || fwrite(out, 1, size, f) != size) return 6;
    fclose(f);
    return 0;
}
