// Y (+)= the sum of a chunk matmul's K-split partials (gemm.wgsl with 2+ workgroups along z):
// PART holds, split after split, (tokens, rows) floats. One invocation per output.

#include "step.wgsl"

struct Params {
    rows: u32,
    splits: u32,
    y_stride: u32,
    y_off: u32,
    accumulate: u32,  // 1: add to Y (the residual), 0: write it
}

@group(0) @binding(0) var<storage, read> PART: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<uniform> S: Step;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.y;
    if (r >= P.rows || t >= S.n_tokens) {
        return;
    }
    var y = 0.0;
    for (var s = 0u; s < P.splits; s++) {
        y += PART[(s * S.n_tokens + t) * P.rows + r];
    }
    let at = t * P.y_stride + P.y_off + r;
    if (P.accumulate != 0u) {
        y += Y[at];
    }
    Y[at] = y;
}
