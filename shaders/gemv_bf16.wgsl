// y = W x for one token, W in BF16: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// Two bfloat16 per word (element 2k in the low half); a bfloat16 is the high half of an f32, so
// decoding only moves bits. An invocation's unit of work is 16 weights: 2 vec4 loads of W (bound as
// vec4: rows of a multiple of 16 weights are 16-byte aligned) for each of the workgroup's 4 rows,
// then the unit's 4 vec4 of x once for all of them. Fusions as gemv.wgsl (P.mode).

#include "matmul_structs.wgsl"

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;  // invocations per workgroup (a power of two)

#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"
#include "gemv_common.wgsl"

// 4 vec4 of the f32 norm weight from vec4 i on
fn norm16(i: u32) -> mat4x4<f32> {
    let n = P.norm_w / 4u + i;
    return mat4x4<f32>(bitcast<vec4<f32>>(W[n]), bitcast<vec4<f32>>(W[n + 1u]),
                       bitcast<vec4<f32>>(W[n + 2u]), bitcast<vec4<f32>>(W[n + 3u]));
}

// the 2 bfloat16 of each of two words as 4 floats
fn bf16x4(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
}

// 16 weights (two vec4 of words) dotted with their x
fn unit_dot(w0: vec4<u32>, w1: vec4<u32>, x: X16) -> f32 {
    let acc = bf16x4(w0.x, w0.y) * x.v[0] + bf16x4(w0.z, w0.w) * x.v[1]
            + bf16x4(w1.x, w1.y) * x.v[2] + bf16x4(w1.z, w1.w) * x.v[3];
    return dot(acc, vec4<f32>(1.0));
}

// the unit at vec4 b of each of 4 rows, dotted with its x
fn rows_dot(b: vec4<u32>, x: X16) -> vec4<f32> {
    // all 8 loads first, so that they are in flight together
    let a0 = W[b.x];
    let a1 = W[b.y];
    let a2 = W[b.z];
    let a3 = W[b.w];
    let c0 = W[b.x + 1u];
    let c1 = W[b.y + 1u];
    let c2 = W[b.z + 1u];
    let c3 = W[b.w + 1u];
    return vec4<f32>(unit_dot(a0, c0, x), unit_dot(a1, c1, x), unit_dot(a2, c2, x), unit_dot(a3, c3, x));
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let g = group_of(wid);
    let base_a = g.a / 4u;  // W is bound as vec4
    let base_b = g.b / 4u;
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    var sq = 0.0;
    let n_units = P.cols / 16u;
    var norm = mat4x4<f32>();
    for (var u = lid; u < n_units; u += WG) {
        if (g.use_norm) {
            norm = norm16(4u * u);
        }
        let x = x16(g.x, 4u * u, g.use_norm, norm, vec4<f32>(1.0));
        sq += x.sq;
        acc_a += rows_dot(base_a + vec4<u32>(2u * u), x);
        if (g.is_gated) {
            acc_b += rows_dot(base_b + vec4<u32>(2u * u), x);
        }
    }
    finish(acc_a, acc_b, sq, lid, g);
}
