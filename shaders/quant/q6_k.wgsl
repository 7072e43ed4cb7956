// Q6_K: 256 elements in 16 sub-blocks of 16; element = (d * sc) * (q - 32), q = 4 low bits | 2 high
// bits << 4, sc the signed 8-bit scale of its sub-block.
// Re-laid, 53 words a block in groups of 4 blocks (a row's last group may hold fewer): the group's
// d as f32, one word each (padded to 4 words), then each block's 52 words: [0..31] ql, 128 bytes |
// [32..47] qh, 64 bytes | [48..51] the 16 int8 scales. A block's address blk is still its row's
// first word + 53 b (rows start at multiples of 4 words): block j = b % 4 = blk % 4 of its group
// has d at blk - 52j and its 52 words from blk - j + 4 on, 16-byte aligned.
// Each half h of 128 elements uses ql bytes 64h..64h+63 (elements 0-63 of the half in the low
// nibbles, 64-127 in the high nibbles) and qh bytes 32h..32h+31 (bits 2k..2k+1 of byte j for
// element 32k + j of the half).
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 256u;
const BLOCK_WORDS: u32 = 53u;

#include "quant/q6_k_words.wgsl"

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let at = q6k_words(blk);
    let d = bitcast<f32>(W[at.x]);
    let half = i >> 5u;
    let r = i & 31u;  // elements 4r..4r+3 of the half
    let wl = W[at.y + 16u * half + (r & 15u)];
    let sl = (r >> 4u) * 4u;
    let low = (vec4<u32>(wl) >> vec4<u32>(sl, sl + 8u, sl + 16u, sl + 24u)) & vec4<u32>(0xFu);
    let wh = W[at.y + 32u + 8u * half + (r & 7u)];
    let sh = (r >> 3u) * 2u;
    let high = (vec4<u32>(wh) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(3u);
    let q = vec4<i32>(low | (high << vec4<u32>(4u))) - vec4<i32>(32);
    let ws = W[at.y + 48u + (i >> 4u)];
    let sc = bitcast<i32>(ws << (24u - 8u * ((i >> 2u) & 3u))) >> 24u;
    return (d * f32(sc)) * vec4<f32>(q);
}
