// The parameters of the attention programs (attention_decode.wgsl, attention_prefill.wgsl).

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,        // cache capacity in positions
    window: u32,       // 0: the whole context
    scale: f32,        // 1 / sqrt(head_dim)
    qkv_stride: u32,   // floats per token in QKV
    softcap: f32,      // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2); 0: off
}
