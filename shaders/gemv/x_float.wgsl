// gemv.wgsl's x for the float units: each unit reads its own from X (gemv_common.wgsl's x16), so
// nothing is staged and a row is one chunk.

const INT8_X: u32 = 0u;

fn chunk_units(n_units: u32) -> u32 {
    return n_units;
}

fn stage_x(first_token: u32, n_tokens: u32, u0: u32, lid: u32) {}

// the first vec4 of token first_token + t's row of X
fn token_x(t: u32, first_token: u32, u0: u32) -> u32 {
    return x_row(first_token + t);
}
