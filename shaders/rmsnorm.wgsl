// RMSNorm of each token's row: x / sqrt(mean(x^2) + eps) * w, workgroup per token (256 invocations:
// with 64 a chunk's norm ran twice as long, bound by each invocation's chain of loads).
// P.add = 0: Y = norm(X) (a chunk's input to gemm.wgsl, the final norm before the LM head);
// P.add = 1: Y += norm(X) (Gemma's norms after attention and after the FFN, then the residual add).
// P.splits > 0: X is the residual, and the P.splits K-split partials in PART of the matmul before
// (gemm.wgsl, split after split (tokens, n) floats) are added to it first and written back: the work
// of split_sum.wgsl, without a dispatch and a pass of its own.

struct Params {
    n: u32,          // row length
    norm_w: u32,     // word offset of the f32 weight in W
    eps: f32,
    add: u32,
    x_stride: u32,
    y_stride: u32,
    splits: u32,
}

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read_write> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<storage, read> PART: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;
@group(0) @binding(5) var<uniform> S: Step;

const WG: u32 = 256u;

#include "workgroup_reduce.wgsl"

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let token = wid.x;
    if (token >= S.n_tokens) {
        return;
    }
    let x = token * P.x_stride;
    let y = token * P.y_stride;
    var sum = 0.0;
    for (var i = lid; i < P.n; i += WG) {
        var v = X[x + i];
        if (P.splits != 0u) {
            for (var s = 0u; s < P.splits; s++) {
                v += PART[(s * S.n_tokens + token) * P.n + i];
            }
            X[x + i] = v;  // read back below by this invocation only
        }
        sum += v * v;
    }
    let inv = inverseSqrt(workgroup_sum(sum, lid) / f32(P.n) + P.eps);
    for (var i = lid; i < P.n; i += WG) {
        let v = X[x + i] * inv * bitcast<f32>(W[P.norm_w + i]);
        if (P.add == 1u) {
            Y[y + i] = Y[y + i] + v;
        } else {
            Y[y + i] = v;
        }
    }
}
