// The parameters of QK-norm + RoPE + K/V write: rope.wgsl's Params, and the second uniform of
// attention_decode.wgsl's decode variant, which does the same work for its one new position.

struct RopeParams {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    rope_dim: u32,
    neox: u32,         // 1: NeoX pairing
    qk_norm: u32,      // 1: RMSNorm each Q and K head first
    q_norm_w: u32,     // word offsets of the f32 norm weights in W
    k_norm_w: u32,
    eps: f32,
    qkv_stride: u32,   // floats per token in QKV (q | k | v)
    n_ctx: u32,        // cache capacity in positions
    table: u32,        // first float of this layer's angle table in T (per base)
    qkv_bias: u32,     // 1: add the biases at word offsets q_bias, k_bias, v_bias of W
    q_bias: u32,
    k_bias: u32,
    v_bias: u32,
    // rope.wgsl: QKV's columns in up to three groups (a matmul each: Q4_K_M's Q and K, then V), from
    // column 0, start1 and start2 (qkv_stride where there are fewer); group g with splits_g > 0 lies
    // in PARTg as its K-split partials, split after split (tokens, the group's columns), else in QKV
    splits0: u32,
    splits1: u32,
    splits2: u32,
    start1: u32,
    start2: u32,
}

// The pair (first, second) of dims rotated by angle index i.
// Pairs: "normal" (2i, 2i+1), "neox" (i, i + rope_dim/2).
fn rope_pair(i: u32, neox: u32, rope_dim: u32) -> vec2<u32> {
    if (neox == 1u) {
        return vec2<u32>(i, i + rope_dim / 2u);
    }
    return vec2<u32>(2u * i, 2u * i + 1u);
}
