// Dequantize whole blocks of a re-laid tensor to f32 with the shared decoder `dq4` of one quant
// type: each invocation writes 4 values. Block b of a row is at the row's first word + b * BLOCK_WORDS
// (the address every decoder takes, Q6_K's groups of blocks included).
// Used by quant-verify and the tests; the matmul kernels include the same decoder files.

struct Params {
    first_word: u32,  // where the first row starts inside the W binding
    n_quads: u32,     // groups of 4 values to write
    row_words: u32,
    row_blocks: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<u32>>;  // f32 bits
@group(0) @binding(2) var<uniform> params: Params;

#include "{DECODER}"

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let quad = gid.y * groups.x * 64u + gid.x;
    if quad >= params.n_quads {
        return;
    }
    let per_block = QK / 4u;
    let block = quad / per_block;
    let row = block / params.row_blocks;
    let blk = params.first_word + row * params.row_words + (block - row * params.row_blocks) * BLOCK_WORDS;
    // stored as bits so that no store can flush or canonicalize a value
    out[quad] = bitcast<vec4<u32>>(dq4(blk, quad % per_block));
}
