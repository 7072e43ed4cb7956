// y = W x for one token, W in Q8_0: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q8_0.wgsl's block is 9 words (d as f32, then 32 int8), not 16-byte aligned, so W is read as
// words. An invocation's unit of work is half a block, 16 weights: it loads the unit of each of the
// workgroup's 4 rows, then the unit's 4 vec4 of x once for all of them, and turns bytes into floats
// with bit operations (bytes_scaled of the bytes plus 128, then 128 sum(x) taken off). Fusions as
// gemv.wgsl (P.mode).

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;  // invocations per workgroup (a power of two)
const BLOCK_WORDS: u32 = 9u;

#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"
#include "gemv_common.wgsl"

// 4 vec4 of the f32 norm weight from vec4 i on
fn norm16(i: u32) -> mat4x4<f32> {
    return mat4x4<f32>(norm_weight(i), norm_weight(i + 1u), norm_weight(i + 2u), norm_weight(i + 3u));
}

// half h of the block at word blk dotted with its x: d ((q + 128) . x - 128 sum(x))
fn unit_dot(d: f32, q: vec4<u32>, x: X16) -> f32 {
    let flip = vec4<u32>(0x80808080u) ^ q;
    let acc = dot(bytes_scaled(flip.x), x.v[0]) + dot(bytes_scaled(flip.y), x.v[1])
            + dot(bytes_scaled(flip.z), x.v[2]) + dot(bytes_scaled(flip.w), x.v[3]);
    return d * (acc - 128.0 * x.sum);
}

fn quants(first: u32) -> vec4<u32> {
    return vec4<u32>(W[first], W[first + 1u], W[first + 2u], W[first + 3u]);
}

// the unit (half h of the block at word offset blk) of the 4 rows starting at word b, dotted with its x
fn rows_dot(b: vec4<u32>, h: u32, x: X16) -> vec4<f32> {
    // all loads first, so that they are in flight together
    let q = 1u + 4u * h;
    let d = vec4<f32>(bitcast<f32>(W[b.x]), bitcast<f32>(W[b.y]), bitcast<f32>(W[b.z]), bitcast<f32>(W[b.w]));
    let q0 = quants(b.x + q);
    let q1 = quants(b.y + q);
    let q2 = quants(b.z + q);
    let q3 = quants(b.w + q);
    return vec4<f32>(unit_dot(d.x, q0, x), unit_dot(d.y, q1, x), unit_dot(d.z, q2, x), unit_dot(d.w, q3, x));
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let g = group_of(wid);
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    var sq = 0.0;
    let n_units = P.cols / 16u;
    var norm = mat4x4<f32>();
    for (var u = lid; u < n_units; u += WG) {
        let blk = vec4<u32>((u >> 1u) * BLOCK_WORDS);
        if (g.use_norm) {
            norm = norm16(4u * u);
        }
        let x = x16(g.x, 4u * u, g.use_norm, norm, BYTE_SCALE);
        sq += x.sq;
        acc_a += rows_dot(g.a + blk, u & 1u, x);
        if (g.is_gated) {
            acc_b += rows_dot(g.b + blk, u & 1u, x);
        }
    }
    finish(acc_a, acc_b, sq, lid, g);
}
