// What gemv.wgsl's units for Q4_0, Q4_1, Q5_0 and Q5_1 share: a unit is one 32-weight block,
// BLOCK_WORDS words (not 16-byte aligned, so W is read as words): [0] the head (d as f32, or d and
// m as f16), [1] qh where QH_WORDS is 1, then 4 quant words whose byte j holds element j in its low
// nibble and j + 16 in its high one. The low nibbles (with bit j of qh at bit 4 for the 5-bit
// types) are elements 0..15 as bytes, the high nibbles (bit 16 + j) 16..31, each dotted four at a
// time with its 16 x rounded to 8 bits (gemv/x_int8.wgsl), and block_dot turns the two integer
// sums into the block's sum: d (q - OFFSET) without a min (the head is d as f32), d q + m with one
// (d and m as f16 in the head). Needs the type file's BLOCK_WORDS, QH_WORDS, OFFSET and HAS_MIN.

const UNIT: u32 = 32u;

alias XU = X8x2;

fn unit_x(x: u32, u: u32) -> XU {
    return x8x2(x, 2u * u, 2u * u + 1u);
}

// a block's words, loaded together
struct Block32 {
    head: u32,
    qh: u32,       // 0 for the 4-bit types
    q: vec4<u32>,
}

fn block32_load(blk: u32) -> Block32 {
    let at = blk + 1u + QH_WORDS;
    var qh = 0u;
    if (QH_WORDS == 1u) {
        qh = W[blk + 1u];
    }
    return Block32(W[blk], qh, vec4<u32>(W[at], W[at + 1u], W[at + 2u], W[at + 3u]));
}

// qh bits first..first + 15, four to a word of bytes (bit first + 4c + e at bit 4 of byte e of word c)
fn qh_bytes(qh: u32, first: u32) -> vec4<u32> {
    // a nibble times 0x204081 puts its bits at 0, 8, 16 and 24 (and others that the mask drops)
    let n = (vec4<u32>(qh) >> (vec4<u32>(first) + vec4<u32>(0u, 4u, 8u, 12u))) & vec4<u32>(0xFu);
    return ((n * vec4<u32>(0x00204081u)) & vec4<u32>(ONES)) << vec4<u32>(4u);
}

// d step (q . x - OFFSET sum(x)) + m sum(x) over both halves
fn block_dot(b: Block32, x: X8x2) -> f32 {
    var lo = low_nibbles(b.q);
    var hi = high_nibbles(b.q);
    if (QH_WORDS == 1u) {
        lo |= qh_bytes(b.qh, 0u);
        hi |= qh_bytes(b.qh, 16u);
    }
    var d = bitcast<f32>(b.head);
    var m = 0.0;
    if (HAS_MIN == 1u) {
        let dm = unpack2x16float(b.head);
        d = dm.x;
        m = dm.y;
    }
    return d * (x.lo.step * int_float(dot4(lo, x.lo.q) - OFFSET * x.lo.sum)
              + x.hi.step * int_float(dot4(hi, x.hi.q) - OFFSET * x.hi.sum))
         + m * (x.lo.scaled + x.hi.scaled);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let b = rows + vec4<u32>(u * BLOCK_WORDS);
    // all loads first, so that they are in flight together
    let b0 = block32_load(b.x);
    let b1 = block32_load(b.y);
    let b2 = block32_load(b.z);
    let b3 = block32_load(b.w);
    return vec4<f32>(block_dot(b0, x), block_dot(b1, x), block_dot(b2, x), block_dot(b3, x));
}
