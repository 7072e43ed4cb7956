// (scale, min) of sub-block s of a Q4_K or Q5_K block at word blk: the 12 bytes at words 1..3.
// Bytes 0-3 hold the scales of 0-3 and bytes 4-7 their mins (low 6 bits); sub-blocks 4-7 take their
// low 4 bits from bytes 8-11 and their top 2 bits from the spare bits above.

fn k_byte(word: u32, j: u32) -> u32 {
    return (word >> (8u * j)) & 0xFFu;
}

fn k_scale_min(blk: u32, s: u32) -> vec2<u32> {
    let j = s & 3u;
    let a = k_byte(W[blk + 1u], j);
    let b = k_byte(W[blk + 2u], j);
    if s < 4u {
        return vec2<u32>(a & 63u, b & 63u);
    }
    let c = k_byte(W[blk + 3u], j);
    return vec2<u32>((c & 15u) | ((a >> 6u) << 4u), (c >> 4u) | ((b >> 6u) << 4u));
}

// (d * scale, dmin * min) of the sub-block holding elements 4i..4i+3
fn k_scaled(blk: u32, i: u32) -> vec2<f32> {
    let dmin = unpack2x16float(W[blk]);
    let sm = k_scale_min(blk, i >> 3u);
    return dmin * vec2<f32>(f32(sm.x), f32(sm.y));
}
