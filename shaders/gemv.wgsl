// y = W x for batch-1 decode (wid.y picks the token when a few tokens go through it).
// W stays quantized. A workgroup of 256 invocations makes ROWS_WG output rows, 4 at a time (gated:
// 4 gate rows and their 4 up rows): the workgroup's subgroups share the row quads, and when there
// are more subgroups than quads (small matrices, so that the rows spread over many workgroups)
// several subgroups take one quad and split its units between them. A subgroup's lanes stride over
// the units (UNIT weights each, decoded by gemv/{GEMV_UNIT}.wgsl), keep 4 partial sums in a vec4
// and add them across the subgroup (lanes_{REDUCE}.wgsl); the subgroups of a quad then meet once
// in workgroup memory. The unit's x is loaded once for the 4 rows.
// P.mode fusions (activation.wgsl): RMSNorm of the input (every subgroup reads its share of x anyway,
// so the sum of squares costs no extra pass; 1/rms applied to the sums), gated activation, residual
// add; up to three weight segments (e.g. attn_q, attn_k, attn_v of one type) make one output.

#include "matmul_structs.wgsl"

@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = 256u;
const ROWS_WG: u32 = {GEMV_ROWS_WG}u;  // output rows per workgroup: 4, 8, 16 or 32
const QUADS: u32 = ROWS_WG / 4u;

#include "activation.wgsl"
#include "gemv_common.wgsl"
#include "lanes_{REDUCE}.wgsl"
// binding 0 (W), UNIT, XU, unit_x and unit_rows come from the unit file
#include "gemv/{GEMV_UNIT}.wgsl"

var<workgroup> partial: array<vec4<f32>, 3u * WG>;  // (subgroup, a | b | sq) of each subgroup's sums

// first word of each of the 4 rows from `row` on (rows past the end repeat the last one); with
// `up`, of the up-projection rows paired with them (MODE_GATED)
fn row_words(row: u32, up: bool) -> vec4<u32> {
    let ids = min(vec4<u32>(row) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(P.rows - 1u));
    if (up) {
        return vec4<u32>(P.w1) + ids * P.row_words;
    }
    return vec4<u32>(row_base(ids.x), row_base(ids.y), row_base(ids.z), row_base(ids.w));
}

fn write_rows(row: u32, token: u32, a: vec4<f32>, b: vec4<f32>, sq: f32) {
    var inv = 1.0;
    if ((P.mode & MODE_NORM) != 0u) {
        inv = inverseSqrt(sq / f32(P.cols) + P.eps);
    }
    for (var r = 0u; r < 4u; r++) {
        if (row + r < P.rows) {
            write_y(token * P.y_stride + P.y_off + row + r, a[r], b[r], inv);
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let lanes = lane_count();
    let lane = lid % lanes;
    let sub = lid / lanes;
    let n_sub = WG / lanes;
    let n_units = P.cols / UNIT;
    // subgroups per quad: as many as the workgroup has to spare, but each lane with a unit
    let split = max(1u, min(n_sub / QUADS, (n_units + lanes - 1u) / lanes));
    let per_pass = max(1u, n_sub / split);   // quads made at once
    let token = wid.y;
    let x = x_row(token);
    let gated_mode = (P.mode & MODE_GATED) != 0u;
    for (var first = 0u; first < QUADS; first += per_pass) {
        let quad = first + sub / split;
        let row = wid.x * ROWS_WG + 4u * quad;
        var acc_a = vec4<f32>(0.0);
        var acc_b = vec4<f32>(0.0);
        var sq = 0.0;
        if (sub / split < per_pass && quad < QUADS && row < P.rows) {
            let a = row_words(row, false);
            let b = row_words(row, true);
            for (var u = (sub % split) * lanes + lane; u < n_units; u += split * lanes) {
                let xu = unit_x(x, u);
                sq += xu.sq;
                acc_a += unit_rows(a, u, xu);
                if (gated_mode) {
                    acc_b += unit_rows(b, u, xu);
                }
            }
        }
        let total_a = lanes_sum4(acc_a, lid);
        let total_b = lanes_sum4(acc_b, lid);
        let total_sq = lanes_sum1(sq, lid);
        workgroupBarrier();
        if (lane == 0u) {
            partial[3u * sub] = total_a;
            partial[3u * sub + 1u] = total_b;
            partial[3u * sub + 2u] = vec4<f32>(total_sq);
        }
        workgroupBarrier();
        // invocation i < per_pass adds the sums of quad first + i over its subgroups and writes it
        let q = first + lid;
        if (lid < per_pass && q < QUADS && wid.x * ROWS_WG + 4u * q < P.rows) {
            var a = vec4<f32>(0.0);
            var b = vec4<f32>(0.0);
            var s = 0.0;
            for (var k = 0u; k < split; k++) {
                let at = 3u * (lid * split + k);
                a += partial[at];
                b += partial[at + 1u];
                s += partial[at + 2u].x;
            }
            write_rows(wid.x * ROWS_WG + 4u * q, token, a, b, s);
        }
    }
}
