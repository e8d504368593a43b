// llama.cpp's own logits for one token sequence, teacher-forced: the trunk's, its NextN hidden states, and every
// MTP head's, as libllama computes them. The parity tests (tests/runtime/test_llama_cpp_parity.py) compare the
// torch runtime with this, position by position.
//
//   mtp_harness MODEL.gguf TOKENS.i32 OUT.bin [THREADS [f32|- [HEAD.gguf]]]
//
// With HEAD.gguf the heads are that file's (a head file beside a trunk-only MODEL, as llama.cpp's -md loads it:
// DeepSeek-V4's head lives in a file of its own); the MTP context is made from the head model, against the trunk's.
//
// With "f32" the KV caches hold f32 and attention runs without flash attention (whose K and V are f16 even over an
// f32 cache): llama.cpp's f32 computation, for graphs with a discrete choice (DeepSeek sparse attention's top-k)
// that f16 storage of keys can flip.
//
// The MTP context is fed the way llama.cpp's draft-mtp driver (common/speculative.cpp) feeds it on a prompt:
// the entry at position p holds token x_p and the trunk's NextN state h_{p-1} (zeros at p = 0), so its logits
// predict x_{p+1}. Every head (llama_set_nextn_layer_offset) gets the same trunk states, as the driver's catch-up
// pass gives them. The state goes in with llama_batch_ext_set_embd_token: llama_batch_ext_set_embd_state is still
// a stub in this llama.cpp (it returns false), and the driver itself uses the token embedding slot, whose width
// is n_embd_out in an MTP context.
//
// OUT.bin: magic "MTPH", then int32 n_tokens, n_vocab, n_embd, n_heads; then float32 trunk logits [n, vocab],
// trunk NextN states [n, embd], and per head its logits [n, vocab] and its NextN output [n, embd].

#include "llama.h"
#include "llama-ext.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static int fail(const char * what) {
    fprintf(stderr, "mtp_harness: %s\n", what);
    return 1;
}

static bool write_rows(FILE * f, const float * (*row)(llama_context *, int32_t), llama_context * ctx, int n, int width) {
    for (int i = 0; i < n; ++i) {
        const float * r = row(ctx, i);
        if (r == nullptr || fwrite(r, sizeof(float), width, f) != (size_t) width) {
            return false;
        }
    }
    return true;
}

static const float * logits_row(llama_context * ctx, int32_t i) { return llama_get_logits_ith(ctx, i); }
static const float * nextn_row(llama_context * ctx, int32_t i) { return llama_get_embeddings_nextn_ith(ctx, i); }

int main(int argc, char ** argv) {
    if (argc < 4) {
        return fail("usage: mtp_harness MODEL.gguf TOKENS.i32 OUT.bin [THREADS [f32|- [HEAD.gguf]]]");
    }
    const int n_threads = argc > 4 ? atoi(argv[4]) : 1;
    const bool f32_cache = argc > 5 && strcmp(argv[5], "f32") == 0;
    const char * head_path = argc > 6 ? argv[6] : nullptr;

    std::vector<llama_token> tokens;
    {
        FILE * f = fopen(argv[2], "rb");
        if (!f) {
            return fail("cannot read the tokens file");
        }
        int32_t t;
        while (fread(&t, sizeof(t), 1, f) == 1) {
            tokens.push_back(t);
        }
        fclose(f);
    }
    const int n = (int) tokens.size();
    if (n < 2) {
        return fail("need at least two tokens");
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.load_mtp = true;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        return fail("cannot load the model");
    }
    llama_model * head_model = model;
    if (head_path) {
        head_model = llama_model_load_from_file(head_path, mparams);
        if (!head_model) {
            return fail("cannot load the head file");
        }
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_embd = llama_model_n_embd_out(model);
    const int n_heads = llama_model_n_layer_nextn(head_model);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n < 64 ? 64 : n;
    cparams.n_batch = cparams.n_ubatch = n;
    cparams.n_seq_max = 1;
    cparams.n_threads = cparams.n_threads_batch = n_threads;
    cparams.no_perf = true;
    if (f32_cache) {
        cparams.type_k = cparams.type_v = GGML_TYPE_F32;
        cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        return fail("cannot create the trunk context");
    }
    llama_set_embeddings_nextn(ctx, true, false);

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        return fail("trunk decode failed");
    }

    FILE * out = fopen(argv[3], "wb");
    if (!out) {
        return fail("cannot write the output file");
    }
    const int32_t header[4] = {n, n_vocab, n_embd, n_heads};
    fwrite("MTPH", 1, 4, out);
    fwrite(header, sizeof(int32_t), 4, out);
    if (!write_rows(out, logits_row, ctx, n, n_vocab) || !write_rows(out, nextn_row, ctx, n, n_embd)) {
        return fail("the trunk gave no logits or NextN states");
    }

    // h_{p-1} beside x_p: row p of `state` is the trunk's row p - 1, zeros at p = 0
    std::vector<float> state((size_t) n * n_embd, 0.0f);
    for (int p = 1; p < n; ++p) {
        memcpy(state.data() + (size_t) p * n_embd, llama_get_embeddings_nextn_ith(ctx, p - 1), n_embd * sizeof(float));
    }

    if (n_heads > 0) {
        llama_context_params dparams = cparams;
        dparams.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        dparams.ctx_other = ctx;
        dparams.n_rs_seq = 0;
        llama_context * dft = llama_init_from_model(head_model, dparams);
        if (!dft) {
            return fail("cannot create the MTP context");
        }
        llama_set_embeddings_nextn(dft, true, true);
        llama_batch_ext * b = llama_batch_ext_init(dft);
        for (int head = 0; head < n_heads; ++head) {
            llama_memory_clear(llama_get_memory(dft), true);
            llama_set_nextn_layer_offset(dft, head);
            llama_batch_ext_clear(b);
            for (int p = 0; p < n; ++p) {
                const int32_t idx = llama_batch_ext_add_token(b, 0, tokens[p]);
                const llama_pos pos = p;
                const llama_embd h = {state.data() + (size_t) p * n_embd, 1, (size_t) n_embd};
                if (idx != p || !llama_batch_ext_set_pos(b, idx, &pos) || !llama_batch_ext_set_embd_token(b, idx, h) ||
                    !llama_batch_ext_set_output_logits(b, idx, true)) {
                    return fail("cannot build the MTP batch");
                }
            }
            if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, b) != 0) {
                return fail("MTP decode failed");
            }
            if (!write_rows(out, logits_row, dft, n, n_vocab) || !write_rows(out, nextn_row, dft, n, n_embd)) {
                return fail("the MTP head gave no logits or NextN output");
            }
        }
        llama_set_nextn_layer_offset(dft, 0);
        llama_batch_ext_free(b);
        llama_free(dft);
    }
    if (fclose(out) != 0) {
        return fail("cannot finish the output file");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    if (head_model != model) {
        llama_model_free(head_model);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
