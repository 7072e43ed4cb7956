// Where each decode token of a forward stands (airframe/gpu/pipelines.pack_rows): one entry per
// token, which attention_decode.wgsl and attention_merge.wgsl read by the token's row. One token
// alone is row 0; a batch of conversations has a row per conversation, each in its own cache.

struct DecodeRow {
    kv: u32,         // first vec4 of the token's K/V cache (its slot) in the layer's K/V buffer
    n_past: u32,     // positions already in that cache: the token's position
    split_len: u32,  // K/V positions per attention split
    part: u32,       // first float of the token's split partials in PART
}

fn row_splits(r: DecodeRow) -> u32 {
    return (r.n_past + 1u + r.split_len - 1u) / r.split_len;
}
