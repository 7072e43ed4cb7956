// F16: blocks of 4 halves, two per word, as in the file (element 2k in the low half).
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 4u;
const BLOCK_WORDS: u32 = 2u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let w = blk + 2u * i;
    return vec4<f32>(unpack2x16float(W[w]), unpack2x16float(W[w + 1u]));
}
