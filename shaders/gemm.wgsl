// Y = X W^T for a prefill chunk: a workgroup makes a tile of TILE_R weight rows x TILE_T tokens.
// Each step over the input dimension decodes a TILE_R x KSTEP slice of W (dq4 from quant/{QUANT}.wgsl)
// and a TILE_T x KSTEP slice of X into workgroup memory; each of the 256 invocations then owns
// 4 rows x 4 tokens of the tile.
// Params and Step from matmul_params.wgsl; the same bindings and P.mode fusions as gemv.wgsl.
// Needs cols % KSTEP == 0.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

#include "quant/{QUANT}.wgsl"
#include "activation.wgsl"

const WG: u32 = 256u;
const TILE_R: u32 = 64u;
const TILE_T: u32 = 64u;
const KSTEP: u32 = 32u;

var<workgroup> w_a: array<array<f32, 33>, TILE_R>;  // padded against bank conflicts
var<workgroup> w_b: array<array<f32, 33>, TILE_R>;
var<workgroup> x_t: array<array<f32, 33>, TILE_T>;
var<workgroup> inv_rms: array<f32, TILE_T>;

fn first_x_token() -> u32 {
    if ((P.mode & MODE_X_STEP) != 0u) {
        return S.lm_first;
    }
    return 0u;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let row0 = wid.x * TILE_R;
    let tok0 = wid.y * TILE_T;
    let n_tokens = S.n_tokens;
    let x_first = first_x_token();
    let use_norm = (P.mode & MODE_NORM) != 0u;
    let is_gated = (P.mode & MODE_GATED) != 0u;

    if (lid < TILE_T) {
        var inv = 1.0;
        let t = min(tok0 + lid, n_tokens - 1u);
        if (use_norm) {
            let base = (x_first + t) * P.x_stride;
            var sum = 0.0;
            for (var k = 0u; k < P.cols; k++) {
                sum += X[base + k] * X[base + k];
            }
            inv = 1.0 / sqrt(sum / f32(P.cols) + P.eps);
        }
        inv_rms[lid] = inv;
    }

    let my_row = (lid % 16u) * 4u;   // rows my_row .. my_row + 3 of the tile
    let my_tok = (lid / 16u) * 4u;   // tokens my_tok .. my_tok + 3 of the tile
    var acc_a: array<vec4<f32>, 4>;  // (row) x 4 tokens
    var acc_b: array<vec4<f32>, 4>;
    let per_block = QK / 4u;
    for (var k0 = 0u; k0 < P.cols; k0 += KSTEP) {
        workgroupBarrier();
        // decode TILE_R x KSTEP weights: 512 vec4, 2 per invocation
        for (var j = lid; j < TILE_R * (KSTEP / 4u); j += WG) {
            let r = j / (KSTEP / 4u);
            let c4 = j % (KSTEP / 4u);
            let row = min(row0 + r, P.rows - 1u);
            let i = k0 / 4u + c4;
            let blk = (i / per_block) * BLOCK_WORDS;
            let a = dq4(row_base(row) + blk, i % per_block);
            w_a[r][4u * c4] = a.x;
            w_a[r][4u * c4 + 1u] = a.y;
            w_a[r][4u * c4 + 2u] = a.z;
            w_a[r][4u * c4 + 3u] = a.w;
            if (is_gated) {
                let b = dq4(P.w1 + row * P.row_words + blk, i % per_block);
                w_b[r][4u * c4] = b.x;
                w_b[r][4u * c4 + 1u] = b.y;
                w_b[r][4u * c4 + 2u] = b.z;
                w_b[r][4u * c4 + 3u] = b.w;
            }
        }
        // load TILE_T x KSTEP inputs, normalized when asked: 2048 floats, 8 per invocation
        for (var j = lid; j < TILE_T * KSTEP; j += WG) {
            let t = j / KSTEP;
            let c = j % KSTEP;
            let token = min(tok0 + t, n_tokens - 1u);
            var v = X[(x_first + token) * P.x_stride + k0 + c];
            if (use_norm) {
                v = v * inv_rms[t] * bitcast<f32>(W[P.norm_w + k0 + c]);
            }
            x_t[t][c] = v;
        }
        workgroupBarrier();
        for (var c = 0u; c < KSTEP; c++) {
            let xv = vec4<f32>(x_t[my_tok][c], x_t[my_tok + 1u][c], x_t[my_tok + 2u][c], x_t[my_tok + 3u][c]);
            for (var r = 0u; r < 4u; r++) {
                acc_a[r] += w_a[my_row + r][c] * xv;
                if (is_gated) {
                    acc_b[r] += w_b[my_row + r][c] * xv;
                }
            }
        }
    }
    for (var r = 0u; r < 4u; r++) {
        let row = row0 + my_row + r;
        for (var t = 0u; t < 4u; t++) {
            let token = tok0 + my_tok + t;
            if (row < P.rows && token < n_tokens) {
                var y = acc_a[r][t];
                if (is_gated) {
                    y = gated(P.mode, y, acc_b[r][t]);
                }
                let at = token * P.y_stride + P.y_off + row;
                if ((P.mode & MODE_ACCUMULATE) != 0u) {
                    Y[at] = Y[at] + y;
                } else {
                    Y[at] = y;
                }
            }
        }
    }
}
