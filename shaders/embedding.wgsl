// Token embedding lookup (+ scale, e.g. Gemma's sqrt(n_embd)) from one row chunk of token_embd:
// workgroup per token; a token whose row lies outside this chunk is left to another chunk's dispatch.
// The rows stay quantized; dq4 from quant/{QUANT}.wgsl decodes them.

struct Params {
    first_row: u32,   // rows [first_row, first_row + n_rows) are bound in W, from word 0
    n_rows: u32,
    cols: u32,
    row_words: u32,
    scale: f32,
}

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> TOKENS: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;    // (tokens, cols)
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

#include "quant/{QUANT}.wgsl"

const WG: u32 = 64u;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let token = wid.x;
    let id = TOKENS[token];
    if (token >= S.n_tokens || id < P.first_row || id >= P.first_row + P.n_rows) {
        return;
    }
    let row = (id - P.first_row) * P.row_words;
    let per_block = QK / 4u;
    for (var i = lid3.x; i < P.cols / 4u; i += WG) {
        let v = dq4(row + (i / per_block) * BLOCK_WORDS, i % per_block) * P.scale;
        let at = token * P.cols + 4u * i;
        Y[at] = v.x;
        Y[at + 1u] = v.y;
        Y[at + 2u] = v.z;
        Y[at + 3u] = v.w;
    }
}
