// llama.cpp's decode of N conversations at once, as a server with N parallel slots runs them: each
// sequence first reads a prompt of PROMPT random token ids, then STEPS steps of one token per
// sequence are timed (one llama_decode of N tokens each, logits made for every token and waited
// for). Prints the median ms of a step and the aggregate tokens/s per N. The kit's source has no
// batched tool, so this is written against llama.h; concurrency.sh builds it beside llama-bench.
//   llamacpp_batched MODEL 1,4,8 [PROMPT=128] [STEPS=64]
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

// token i of the batch: id t at position pos of sequence seq, its logits made or not
static void put(llama_batch& b, int i, llama_token t, int pos, int seq, bool logits) {
    b.token[i] = t;
    b.pos[i] = pos;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = logits;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL N_LIST [PROMPT] [STEPS]\n", argv[0]);
        return 2;
    }
    const int prompt = argc > 3 ? atoi(argv[3]) : 128;
    const int steps = argc > 4 ? atoi(argv[4]) : 64;
    const int warm = 16;  // steps left untimed at each N (the first steps after a prompt run slow)
    std::vector<int> levels;
    std::stringstream list(argv[2]);
    for (std::string item; std::getline(list, item, ',');) levels.push_back(atoi(item.c_str()));
    const int n_max = *std::max_element(levels.begin(), levels.end());

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 999;
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int per_seq = (prompt + warm + steps + 255) / 256 * 256;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_max * per_seq;
    cp.n_batch = cp.n_ubatch = std::max(prompt, n_max);
    cp.n_seq_max = n_max;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;  // as llama-bench -fa 1
    cp.kv_unified = false;  // each sequence its own cache: no shared prefix
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    llama_batch batch = llama_batch_init(std::max(prompt, n_max), 0, 1);
    std::mt19937 rng(1234);
    for (int n : levels) {
        llama_memory_clear(llama_get_memory(ctx), true);
        for (int s = 0; s < n; s++) {
            batch.n_tokens = prompt;
            for (int i = 0; i < prompt; i++) put(batch, i, rng() % n_vocab, i, s, i == prompt - 1);
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "prompt of sequence %d failed\n", s);
                return 1;
            }
        }
        std::vector<double> ms;
        for (int st = 0; st < warm + steps; st++) {
            batch.n_tokens = n;  // one token per sequence, every logit made
            for (int s = 0; s < n; s++) put(batch, s, rng() % n_vocab, prompt + st, s, true);
            const auto t0 = std::chrono::steady_clock::now();
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "step %d of %d sequences failed\n", st, n);
                return 1;
            }
            llama_synchronize(ctx);
            const auto t1 = std::chrono::steady_clock::now();
            if (st >= warm) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        const double median = ms[ms.size() / 2];
        printf("llama.cpp batched: %d sequences, %.3f ms a step (%.3f-%.3f), %.0f tokens/s\n", n, median, ms.front(),
               ms.back(), 1000.0 * n / median);
        fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
