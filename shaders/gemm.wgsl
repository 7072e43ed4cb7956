enable f16;

// Y = X W^T for a prefill chunk of 2+ tokens, in f16 arithmetic (shader-f16). A workgroup of 256
// invocations makes a tile of TILE_R weight rows x TILE_T tokens; invocation (tr, tc) owns the 4x4
// blocks of rows b * 64 + 4 tr .. +3 and tokens j * 64 + 4 tc .. +3 (RB x TB blocks, never indexed
// dynamically). Per step of KSTEP input columns the workgroup decodes its W tile once (dq4 of
// quant/{QUANT}.wgsl) and loads its X tile, both converted to f16 and stored transposed (column k
// of the tile is a run of vec4) so the inner loop reads 2 + 2 vec4 for 64 FMAs; the next step's
// tiles are fetched into registers while the current one is multiplied. Each step's products are
// summed in f16 (mat4x4<f16>, two lanes per instruction) and added to f32 accumulators: about 1e-3
// of the largest output, where f32 would be 1e-6 (tests/test_gpu_matmul.py states the bound).
// Inputs must stay within f16's range (|x| < 65504), which MODE_NORM guarantees by normalizing
// first; the other inputs are attention outputs and FFN activations.
// P.mode (activation.wgsl): MODE_NORM first sums the squares of each of the tile's token rows and
// loads x / rms * norm weight; MODE_GATED needs TILE_R = 128: the tile's first 64 rows are gate rows
// (P.w0), the next 64 the up rows (P.w1) of the same outputs, and the epilogue writes
// act(gate) * up; MODE_ACCUMULATE adds to Y.
// With Z workgroups along z (a K-split, for matrices with few row tiles) workgroup z sums columns
// z P.cols / Z .. and writes its (tokens, rows) partial at z n_tokens y_stride; split_sum.wgsl
// adds the partials.
// Needs P.cols % (Z KSTEP) == 0 and P.x_stride % 4 == 0.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

#include "quant/{QUANT}.wgsl"
#include "activation.wgsl"

const TILE_R: u32 = {GEMM_TILE_R}u;  // 64 or 128 weight rows
const TILE_T: u32 = {GEMM_TILE_T}u;  // 64 or 128 tokens
const KSTEP: u32 = 32u;
const RB: u32 = TILE_R / 64u;        // 4-row blocks per invocation
const TB: u32 = TILE_T / 64u;        // 4-token blocks per invocation
const WS_STRIDE: u32 = TILE_R / 4u + 1u;  // vec4 per tile column, padded against bank conflicts
const XS_STRIDE: u32 = TILE_T / 4u + 1u;

var<workgroup> ws: array<vec4<f16>, KSTEP * WS_STRIDE>;  // (k, row quad)
var<workgroup> xs: array<vec4<f16>, KSTEP * XS_STRIDE>;  // (k, token quad)
var<workgroup> inv_rms: array<f32, TILE_T>;
var<workgroup> sums: array<f32, 256>;

// What one invocation loads per step: a 4 x 4 piece of each tile (4 rows or tokens x 4 columns),
// kept in registers between the global loads and the workgroup-memory stores.
struct Fetched {
    w: mat4x4<f16>,  // column e: rows 0..3 of the piece at column e
    x: mat4x4<f16>,  // column e: tokens 0..3 at column e
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

fn fetch(lid: u32, k0: u32, rows: array<u32, 4>, toks: array<u32, 4>) -> Fetched {
    var f: Fetched;
    let kq = lid % 8u;
    let c4 = k0 / 4u + kq;             // the piece's first column / 4
    if (lid < TILE_R * 2u) {           // (TILE_R / 4) row quads x 8 column quads
        let per_block = QK / 4u;
        let blk = (c4 / per_block) * BLOCK_WORDS;
        let i = c4 % per_block;
        let w = mat4x4<f32>(dq4(rows[0] + blk, i), dq4(rows[1] + blk, i), dq4(rows[2] + blk, i),
                            dq4(rows[3] + blk, i));
        f.w = mat4x4<f16>(transpose(w));
    }
    if (lid < TILE_T * 2u) {
        var x = mat4x4<f32>(X[toks[0] + c4], X[toks[1] + c4], X[toks[2] + c4], X[toks[3] + c4]);
        if ((P.mode & MODE_NORM) != 0u) {
            let n = norm_weight(c4);
            let t = 4u * (lid / 8u);
            x = mat4x4<f32>(x[0] * (n * inv_rms[t]), x[1] * (n * inv_rms[t + 1u]),
                            x[2] * (n * inv_rms[t + 2u]), x[3] * (n * inv_rms[t + 3u]));
        }
        f.x = mat4x4<f16>(transpose(x));
    }
    return f;
}

fn store(lid: u32, f: Fetched) {
    let kq = lid % 8u;
    let quad = lid / 8u;
    if (lid < TILE_R * 2u) {
        for (var e = 0u; e < 4u; e++) {
            ws[(4u * kq + e) * WS_STRIDE + quad] = f.w[e];
        }
    }
    if (lid < TILE_T * 2u) {
        for (var e = 0u; e < 4u; e++) {
            xs[(4u * kq + e) * XS_STRIDE + quad] = f.x[e];
        }
    }
}

// acc += w (rows) x x (tokens): column c of acc gains w * x[c]
fn outer(acc: mat4x4<f16>, w: vec4<f16>, x: vec4<f16>) -> mat4x4<f16> {
    return mat4x4<f16>(fma(w, vec4<f16>(x.x), acc[0]), fma(w, vec4<f16>(x.y), acc[1]),
                       fma(w, vec4<f16>(x.z), acc[2]), fma(w, vec4<f16>(x.w), acc[3]));
}

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
                write_y(base + t * P.y_stride + P.y_off + row + e, acc[c][e], up[c][e], 1.0);
            }
        }
    }
}

// 1 / rms of each of the tile's tokens into inv_rms: 256 / TILE_T invocations per token row
fn tile_norms(lid: u32, tok0: u32) {
    let per = 256u / TILE_T;
    let t = lid / per;
    let x = x_row(tok0 + t);
    var sq = vec4<f32>(0.0);
    for (var c = lid % per; c < P.cols / 4u; c += per) {
        let v = X[x + c];
        sq += v * v;
    }
    sums[lid] = sq.x + sq.y + sq.z + sq.w;
    workgroupBarrier();
    if (lid < TILE_T) {
        var total = 0.0;
        for (var j = 0u; j < per; j++) {
            total += sums[lid * per + j];
        }
        inv_rms[lid] = inverseSqrt(total / f32(P.cols) + P.eps);
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let lid = lid3.x;
    let tr = lid / 16u;
    let tc = lid % 16u;
    var row0 = wid.x * TILE_R;
    if ((P.mode & MODE_GATED) != 0u) {
        row0 = wid.x * 64u;
    }
    let tok0 = wid.y * TILE_T;
    // the rows and tokens this invocation fetches: quad lid / 8 of each tile
    let quad = lid / 8u;
    var rows: array<u32, 4>;
    var toks: array<u32, 4>;
    for (var e = 0u; e < 4u; e++) {
        rows[e] = tile_row_base(row0, 4u * quad + e);
        toks[e] = x_row(tok0 + 4u * quad + e);
    }

    var a00 = mat4x4<f32>();
    var a01 = mat4x4<f32>();
    var a10 = mat4x4<f32>();
    var a11 = mat4x4<f32>();
    if ((P.mode & MODE_NORM) != 0u) {
        tile_norms(lid, tok0);
    }
    let k_len = P.cols / groups.z;  // this workgroup's columns: k_first ..
    let k_first = wid.z * k_len;
    let base = wid.z * S.n_tokens * P.y_stride;
    var next = fetch(lid, k_first, rows, toks);
    for (var k0 = k_first; k0 < k_first + k_len; k0 += KSTEP) {
        store(lid, next);
        workgroupBarrier();
        if (k0 + KSTEP < k_first + k_len) {
            next = fetch(lid, k0 + KSTEP, rows, toks);
        }
        var p00 = mat4x4<f16>();
        var p01 = mat4x4<f16>();
        var p10 = mat4x4<f16>();
        var p11 = mat4x4<f16>();
        for (var k = 0u; k < KSTEP; k++) {
            let w0 = ws[k * WS_STRIDE + tr];
            let x0 = xs[k * XS_STRIDE + tc];
            p00 = outer(p00, w0, x0);
            if (TB == 2u) {
                let x1 = xs[k * XS_STRIDE + 16u + tc];
                p01 = outer(p01, w0, x1);
                if (RB == 2u) {
                    let w1 = ws[k * WS_STRIDE + 16u + tr];
                    p10 = outer(p10, w1, x0);
                    p11 = outer(p11, w1, x1);
                }
            } else if (RB == 2u) {
                let w1 = ws[k * WS_STRIDE + 16u + tr];
                p10 = outer(p10, w1, x0);
            }
        }
        a00 += mat4x4<f32>(p00);
        a01 += mat4x4<f32>(p01);
        a10 += mat4x4<f32>(p10);
        a11 += mat4x4<f32>(p11);
        workgroupBarrier();
    }
    let t0 = tok0 + 4u * tc;
    if ((P.mode & MODE_GATED) != 0u) {  // blocks a1* are the up projection of blocks a0*
        write_block(a00, a10, row0 + 4u * tr, t0, base);
        if (TB == 2u) {
            write_block(a01, a11, row0 + 4u * tr, t0 + 64u, base);
        }
        return;
    }
    write_block(a00, a00, row0 + 4u * tr, t0, base);
    if (TB == 2u) {
        write_block(a01, a01, row0 + 4u * tr, t0 + 64u, base);
    }
    if (RB == 2u) {
        write_block(a10, a10, row0 + 64u + 4u * tr, t0, base);
        if (TB == 2u) {
            write_block(a11, a11, row0 + 64u + 4u * tr, t0 + 64u, base);
        }
    }
}
