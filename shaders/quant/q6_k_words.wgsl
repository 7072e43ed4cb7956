// Where a Q6_K block's words lie (quant/q6_k.wgsl's groups of 4 blocks): its address blk is its
// row's first word + 53 b, rows starting at multiples of 4 words, so block j = b % 4 = blk % 4 of
// its group has d at blk - 52j and its 52 words (ql, qh, scales) from blk - j + 4 on, 16-byte aligned.

// (the word of d, the first of ql, qh and the scales) of the block at blk
fn q6k_words(blk: u32) -> vec2<u32> {
    let j = blk & 3u;
    return vec2<u32>(blk - 52u * j, blk - j + 4u);
}
