// F32: blocks of 4 floats, one word each, as in the file.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 4u;
const BLOCK_WORDS: u32 = 4u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let w = blk + 4u * i;
    return bitcast<vec4<f32>>(vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]));
}
