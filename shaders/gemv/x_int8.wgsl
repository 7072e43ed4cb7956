// gemv.wgsl's x for the units of the quantized types: each token's x rounded to 8 bits
// (gemv/x_round.wgsl), so a product of weights and x is exact up to x's rounding, about 4e-3 of the
// largest output (tests/test_gpu_matmul.py). Where the rounding happens, by STAGE_X:
// 0: each unit rounds its own blocks as it goes (no barrier, no wait for the rounding), for
//    workgroups of one or two quads, which have nothing to share;
// 1: the workgroup rounds x once, XBLOCKS blocks of 16 values per token at a time, into workgroup
//    memory, where every quad's units read it: for workgroups of 4 quads or more, which would
//    otherwise round each block once per quad;
// 2: the gated gemv before rounded it (MODE_ROUND_OUT) and stored it in X from P.xq_off on, each
//    token's blocks P.cols / 16 after the last's; the units read the stored blocks.

#include "gemv/x_round.wgsl"

const INT8_X: u32 = 1u;
const STAGE_X: u32 = {GEMV_STAGE_X}u;
const XBLOCKS: u32 = {GEMV_XBLOCKS}u;  // blocks of 16 values staged per token: a multiple of 16, or 1

// token t's block b of the chunk at t * XBLOCKS + b, stored as gemv/x_round.wgsl stores blocks
var<workgroup> x_q: array<vec4<u32>, TOKENS * XBLOCKS>;
var<workgroup> x_s: array<vec4<f32>, TOKENS * XBLOCKS>;

// the x of a K-quant unit: two runs of 16 (each against one sub-block's quants)
struct X8x2 {
    lo: X8,
    hi: X8,
    sq: f32,
}

fn chunk_units(n_units: u32) -> u32 {
    if (STAGE_X != 1u) {
        return n_units;
    }
    return XBLOCKS * 16u / UNIT;
}

// blocks u0 * UNIT / 16 .. + XBLOCKS of the group's tokens' x, rounded into x_q and x_s
fn stage_x(first_token: u32, n_tokens: u32, u0: u32, lid: u32) {
    if (STAGE_X != 1u) {
        return;
    }
    let block0 = u0 * UNIT / 16u;
    let n = min(XBLOCKS, P.cols / 16u - block0);
    for (var i = lid; i < TOKENS * XBLOCKS; i += WG) {
        let t = i / XBLOCKS;
        let b = i % XBLOCKS;
        if (t < n_tokens && b < n) {
            let r = round16(x16(x_row(first_token + t), 4u * (block0 + b)));
            x_q[i] = r.q;
            x_s[i] = x8_scales(r);
        }
    }
    workgroupBarrier();
}

// where token t's x is: staged, where its blocks of the chunk from unit u0 start (the unit adds a
// block's index in the row); stored, the vec4 of its first block; else its row of X
fn token_x(t: u32, first_token: u32, u0: u32) -> u32 {
    if (STAGE_X == 0u) {
        return x_row(first_token + t);
    }
    if (STAGE_X == 2u) {
        return P.xq_off / 4u + (first_token + t) * (P.cols / 8u);
    }
    return t * XBLOCKS - u0 * UNIT / 16u;  // wraps around; the sum with a block of the chunk does not
}

// block b (values 16b..16b+15) of the row at `x` (token_x)
fn x8(x: u32, b: u32) -> X8 {
    if (STAGE_X == 0u) {
        return round16(x16(x, 4u * b));
    }
    if (STAGE_X == 2u) {
        return stored_x8(bitcast<vec4<u32>>(X[x + 2u * b]), X[x + 2u * b + 1u]);
    }
    return stored_x8(x_q[x + b], x_s[x + b]);
}

// the x of a K-quant unit: blocks lo and hi of the row at `x` (token_x)
fn x8x2(x: u32, lo: u32, hi: u32) -> X8x2 {
    let a = x8(x, lo);
    let b = x8(x, hi);
    return X8x2(a, b, a.sq + b.sq);
}

// the low and high nibbles of 16 quant bytes, each as a byte
fn low_nibbles(q: vec4<u32>) -> vec4<u32> {
    return q & vec4<u32>(0x0F0F0F0Fu);
}

fn high_nibbles(q: vec4<u32>) -> vec4<u32> {
    return (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
}
