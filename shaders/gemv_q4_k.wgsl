// y = W x for one token, W in Q4_K: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q4_k.wgsl's 144-byte block is 9 vec4: [0] d, dmin (f16) and the 12 bytes of 6-bit scales and
// mins, [1 + t] quant bytes 16t..16t+15. An invocation's unit of work is one quant vec4: 32 weights,
// 16 of sub-block 2c in its low nibbles and 16 of sub-block 2c + 1 in its high nibbles (c = t / 2), so
// 8 invocations share a super-block. Per unit, an invocation loads the unit of each of the
// workgroup's 4 rows (and their up-projection partners when gated), then the 8 vec4 of x once for
// all of them; it decodes each row's two scales and mins once and turns nibbles into floats with bit
// operations (as_floats). W is bound as vec4 (blocks and rows are 16-byte aligned). Fusions as
// gemv.wgsl (P.mode); the fused RMSNorm makes no extra pass over x (1/rms applied after the sums).

#include "matmul_structs.wgsl"

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;  // invocations per workgroup (a power of two)
const BLOCK_VEC4: u32 = 9u;

#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"
#include "gemv_common.wgsl"

// The nibbles stay where they are in the word (bytes 2 and 3 shifted down by 16 to fit the 23-bit
// mantissa), so each float is the nibble times a power of two; x is pre-multiplied by the inverse.
const LOW_SCALE = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
const HIGH_SCALE = vec4<f32>(1.0 / 16.0, 1.0 / 4096.0, 1.0 / 16.0, 1.0 / 4096.0);

fn low_nibbles(w: u32) -> vec4<f32> {
    return as_floats(vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xFu, 0xF00u, 0xFu, 0xF00u));
}

fn high_nibbles(w: u32) -> vec4<f32> {
    return as_floats(vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xF0u, 0xF000u, 0xF0u, 0xF000u));
}

// 4 vec4 of the f32 norm weight from vec4 i on
fn norm16(i: u32) -> mat4x4<f32> {
    let n = P.norm_w / 4u + i;
    return mat4x4<f32>(bitcast<vec4<f32>>(W[n]), bitcast<vec4<f32>>(W[n + 1u]),
                       bitcast<vec4<f32>>(W[n + 2u]), bitcast<vec4<f32>>(W[n + 3u]));
}

// (scale of sub-block 2c, its min, scale of 2c + 1, its min) from the block's first vec4:
// quant/q4_k.wgsl's q4k_scale_min for two neighbouring sub-blocks at once, both bytes in one u32.
fn scales_mins(head: vec4<u32>, c: u32) -> vec4<f32> {
    let shift = 16u * (c & 1u);
    let a = head.y >> shift;
    let b = head.z >> shift;
    let e = head.w >> shift;
    let high = c >= 2u;
    let sc = select(a & 0x3F3Fu, (e & 0x0F0Fu) | ((a >> 2u) & 0x3030u), high);
    let mn = select(b & 0x3F3Fu, ((e >> 4u) & 0x0F0Fu) | ((b >> 2u) & 0x3030u), high);
    return as_floats(vec4<u32>(sc, mn, sc >> 8u, mn >> 8u) & vec4<u32>(0xFFu));
}

// unit t (quant vec4 q of the block whose first vec4 is head) dotted with its x:
// d sc (q . x) - dmin m sum(x), for both sub-blocks
fn unit_dot(head: vec4<u32>, q: vec4<u32>, t: u32, lo: X16, hi: X16) -> f32 {
    let d = unpack2x16float(head.x);
    let sm = scales_mins(head, t >> 1u);
    let dot_lo = dot(low_nibbles(q.x), lo.v[0]) + dot(low_nibbles(q.y), lo.v[1])
               + dot(low_nibbles(q.z), lo.v[2]) + dot(low_nibbles(q.w), lo.v[3]);
    let dot_hi = dot(high_nibbles(q.x), hi.v[0]) + dot(high_nibbles(q.y), hi.v[1])
               + dot(high_nibbles(q.z), hi.v[2]) + dot(high_nibbles(q.w), hi.v[3]);
    return d.x * (sm.x * dot_lo + sm.z * dot_hi) - d.y * (sm.y * lo.sum + sm.w * hi.sum);
}

// unit t of the 4 rows whose blocks start at vec4 b, dotted with its x
fn rows_dot(b: vec4<u32>, t: u32, lo: X16, hi: X16) -> vec4<f32> {
    // all 8 loads first, so that they are in flight together
    let h0 = W[b.x];
    let h1 = W[b.y];
    let h2 = W[b.z];
    let h3 = W[b.w];
    let q0 = W[b.x + 1u + t];
    let q1 = W[b.y + 1u + t];
    let q2 = W[b.z + 1u + t];
    let q3 = W[b.w + 1u + t];
    return vec4<f32>(unit_dot(h0, q0, t, lo, hi), unit_dot(h1, q1, t, lo, hi),
                     unit_dot(h2, q2, t, lo, hi), unit_dot(h3, q3, t, lo, hi));
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
    let n_units = P.cols / 32u;
    var norm_lo = mat4x4<f32>();
    var norm_hi = mat4x4<f32>();
    for (var u = lid; u < n_units; u += WG) {
        let t = u & 7u;
        let blk = vec4<u32>((u >> 3u) * BLOCK_VEC4);
        let at = 64u * (u >> 3u) + 16u * (t >> 1u) + 4u * (t & 1u);  // the unit's first x vec4
        if (g.use_norm) {
            norm_lo = norm16(at);
            norm_hi = norm16(at + 8u);
        }
        let lo = x16(g.x, at, g.use_norm, norm_lo, LOW_SCALE);
        let hi = x16(g.x, at + 8u, g.use_norm, norm_hi, HIGH_SCALE);
        sq += lo.sq + hi.sq;
        acc_a += rows_dot(base_a + blk, t, lo, hi);
        if (g.is_gated) {
            acc_b += rows_dot(base_b + blk, t, lo, hi);
        }
    }
    finish(acc_a, acc_b, sq, lid, g);
}
