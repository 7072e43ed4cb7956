// The per-step values every program of a forward reads (airframe/gpu/pipelines.pack_step).

struct Step {
    n_past: u32,     // positions already in the K/V cache
    n_tokens: u32,   // tokens of this forward
    lm_first: u32,   // the LM head's first input row (MODE_X_STEP)
    split_len: u32,  // K/V positions per split of a decode token's attention
}
