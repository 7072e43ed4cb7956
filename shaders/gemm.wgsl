#include "half_f16.wgsl"

// Y = X W^T for a prefill chunk of 2+ tokens, in f16 arithmetic (shader-f16). A workgroup of 128
// invocations makes a tile of 128 weight rows x 64 tokens; invocation (tr, tc) owns the four 4x4
// blocks of rows 4 tr.. and 64 + 4 tr.. by tokens 4 tc.. and 32 + 4 tc.., never indexed dynamically.
// Per step of KSTEP input columns the workgroup decodes its W tile once (dq4 of quant/{QUANT}.wgsl)
// and loads its X tile, both converted to f16 and stored transposed (column k of the tile is a run
// of 16-byte pairs: row quads q and 16 + q, token quads q and 8 + q), so that the inner loop reads
// one pair of W and one of X per column: 2 loads for 64 FMAs (workgroup-memory loads, not
// arithmetic, bounded smaller register tiles). Each step loads its own tiles when it starts;
// fetching the next step's into registers while the current one is multiplied ran 4-8% slower
// (docs/DECISIONS.md). Each step's products are summed in f16 (mat4x4<f16>) and added to f32
// accumulators: about 1e-3 of the largest output, where f32 would be 1e-6 (tests/test_gpu_matmul.py
// states the bound).
// Inputs must stay within f16's range (|x| < 65504): a normalized residual (the chunk's RMSNorm
// runs before, as rmsnorm.wgsl, once per token instead of once per workgroup), attention outputs and
// FFN activations.
// P.mode (activation.wgsl): MODE_GATED: the tile's first 64 rows are gate rows (P.w0), the next
// 64 the up rows (P.w1) of the same outputs, and the epilogue writes act(gate) * up;
// MODE_ACCUMULATE adds to Y. MODE_NORM is not read here.
// With Z workgroups along z (a K-split, for matrices with few row tiles) workgroup z sums steps
// z S / Z .. (z + 1) S / Z of the S = P.cols / KSTEP and writes its (tokens, rows) partial at
// z n_tokens y_stride; split_sum.wgsl adds the partials.
// Needs P.cols % KSTEP == 0, Z <= P.cols / KSTEP and P.x_stride % 4 == 0.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

#include "quant/{QUANT}.wgsl"
#include "activation.wgsl"

const WG: u32 = 128u;
const TILE_R: u32 = 128u;
const TILE_T: u32 = 64u;
const KSTEP: u32 = 32u;
const WS_STRIDE: u32 = 17u;          // pairs per tile column: 16, and one against bank conflicts
const XS_STRIDE: u32 = 9u;

var<workgroup> ws: array<mat2x4<f16>, KSTEP * WS_STRIDE>;  // (k, row quad q): rows of quads q | 16 + q
var<workgroup> xs: array<mat2x4<f16>, KSTEP * XS_STRIDE>;  // (k, token quad q): tokens of quads q | 8 + q

// What invocation (quad p = lid / 8, column quad lid % 8) loads per step, between the global loads
// and the workgroup-memory stores: column e of each is 4 rows or tokens at column e.
struct Fetched {
    w0: mat4x4<f16>,  // rows 4p .. 4p + 3
    w1: mat4x4<f16>,  // rows 64 + 4p ..
    x: mat4x4<f16>,   // tokens 4p .. 4p + 3
}

// first word of tile row r of this workgroup (rows past the end repeat the last one)
fn tile_row_base(row0: u32, r: u32) -> u32 {
    if ((P.mode & MODE_GATED) != 0u) {
        let idx = min(row0 + r % 64u, P.rows - 1u);
        return select(P.w0, P.w1, r >= 64u) + idx * P.row_words;
    }
    return row_base(min(row0 + r, P.rows - 1u));
}

fn x_row(token: u32) -> u32 {
    var t = min(token, S.n_tokens - 1u);
    if ((P.mode & MODE_X_STEP) != 0u) {
        t = S.lm_first + t;
    }
    return t * P.x_stride / 4u;
}

// src: the first words of the invocation's 8 weight rows, then the first vec4 of its 4 tokens
fn fetch(lid: u32, k0: u32, src: array<u32, 12>) -> Fetched {
    var f: Fetched;
    let c4 = k0 / 4u + lid % 8u;  // the piece's first column / 4
    let per_block = QK / 4u;
    let blk = (c4 / per_block) * BLOCK_WORDS;
    let i = c4 % per_block;
    let w0 = mat4x4<f32>(dq4(src[0] + blk, i), dq4(src[1] + blk, i), dq4(src[2] + blk, i), dq4(src[3] + blk, i));
    let w1 = mat4x4<f32>(dq4(src[4] + blk, i), dq4(src[5] + blk, i), dq4(src[6] + blk, i), dq4(src[7] + blk, i));
    f.w0 = mat4x4<f16>(transpose(w0));
    f.w1 = mat4x4<f16>(transpose(w1));
    let x = mat4x4<f32>(X[src[8] + c4], X[src[9] + c4], X[src[10] + c4], X[src[11] + c4]);
    f.x = mat4x4<f16>(transpose(x));
    return f;
}

fn store(lid: u32, f: Fetched) {
    let kq = lid % 8u;
    let quad = lid / 8u;
    for (var e = 0u; e < 4u; e++) {
        let k = 4u * kq + e;
        ws[k * WS_STRIDE + quad] = mat2x4<f16>(f.w0[e], f.w1[e]);
        xs[k * XS_STRIDE + quad % 8u][quad / 8u] = f.x[e];
    }
}

// outer(acc, w, x): acc += w (rows) x x (tokens)
#include "outer_half.wgsl"

// writes the 4 x 4 block `acc` of rows row .. row + 3 and tokens token .. token + 3 (and `up`, the
// matching up-projection block, when gated)
fn write_block(acc: mat4x4<f32>, up: mat4x4<f32>, row: u32, token: u32, base: u32) {
    for (var c = 0u; c < 4u; c++) {
        let t = token + c;
        if (t >= S.n_tokens) {
            return;
        }
        for (var e = 0u; e < 4u; e++) {
            if (row + e < P.rows) {
                write_y(P.mode, base + t * P.y_stride + P.y_off + row + e, acc[c][e], up[c][e], 1.0);
            }
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let lid = lid3.x;
    let tr = lid / 8u;
    let tc = lid % 8u;
    var row0 = wid.x * TILE_R;
    if ((P.mode & MODE_GATED) != 0u) {
        row0 = wid.x * 64u;
    }
    let tok0 = wid.y * TILE_T;
    let quad = lid / 8u;
    var src: array<u32, 12>;
    for (var e = 0u; e < 4u; e++) {
        src[e] = tile_row_base(row0, 4u * quad + e);
        src[4u + e] = tile_row_base(row0, 64u + 4u * quad + e);
        src[8u + e] = x_row(tok0 + 4u * quad + e);
    }

    var a00 = mat4x4<f32>();  // rows 4 tr.., tokens 4 tc..
    var a01 = mat4x4<f32>();  // rows 4 tr.., tokens 32 + 4 tc..
    var a10 = mat4x4<f32>();  // rows 64 + 4 tr..
    var a11 = mat4x4<f32>();
    let steps = P.cols / KSTEP;  // this workgroup's columns: steps z steps / Z .. (z + 1) steps / Z
    let k_first = wid.z * steps / groups.z * KSTEP;
    let k_end = (wid.z + 1u) * steps / groups.z * KSTEP;
    let base = wid.z * S.n_tokens * P.y_stride;
    for (var k0 = k_first; k0 < k_end; k0 += KSTEP) {
        store(lid, fetch(lid, k0, src));
        workgroupBarrier();
        var p00 = mat4x4<f16>();
        var p01 = mat4x4<f16>();
        var p10 = mat4x4<f16>();
        var p11 = mat4x4<f16>();
        for (var k = 0u; k < KSTEP; k++) {
            let w = ws[k * WS_STRIDE + tr];
            let x = xs[k * XS_STRIDE + tc];
            p00 = outer(p00, w[0], x[0]);
            p01 = outer(p01, w[0], x[1]);
            p10 = outer(p10, w[1], x[0]);
            p11 = outer(p11, w[1], x[1]);
        }
        a00 += mat4x4<f32>(p00);
        a01 += mat4x4<f32>(p01);
        a10 += mat4x4<f32>(p10);
        a11 += mat4x4<f32>(p11);
        workgroupBarrier();
    }
    let t0 = tok0 + 4u * tc;
    let r0 = row0 + 4u * tr;
    if ((P.mode & MODE_GATED) != 0u) {  // blocks a1* are the up projection of blocks a0*
        write_block(a00, a10, r0, t0, base);
        write_block(a01, a11, r0, t0 + 32u, base);
        return;
    }
    write_block(a00, a00, r0, t0, base);
    write_block(a01, a01, r0, t0 + 32u, base);
    write_block(a10, a10, r0 + 64u, t0, base);
    write_block(a11, a11, r0 + 64u, t0 + 32u, base);
}
