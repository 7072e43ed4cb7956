// Combines the splits of attention_decode.wgsl: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)
// with M the largest running max, for each decode token of a batch. Workgroup (head, row of the
// batch: decode_rows.wgsl); output (rows, n_head * head_dim). A row of one split was written by
// attention_decode.wgsl itself and is left alone.
// Each split's weight e^(m_s - M) / total is computed once, by one invocation per split, so the
// output loop only streams the partial outputs (independent loads, no chain through exp).

struct Params {
    n_head: u32,
    head_dim: u32,
}

#include "decode_rows.wgsl"

@group(0) @binding(0) var<storage, read> PART: array<f32>;        // per row, (n_head, splits, head_dim + 2)
@group(0) @binding(1) var<storage, read_write> OUT: array<f32>;   // (rows, n_head * head_dim)
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read> ROWS: array<DecodeRow>;

const WG: u32 = 64u;
const MAX_SPLITS: u32 = 256u;
const EMPTY: f32 = -1.0e30;

var<workgroup> weight: array<f32, MAX_SPLITS>;

#include "workgroup_reduce.wgsl"

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) head: vec3<u32>) {
    let lid = lid3.x;
    let hd = P.head_dim;
    let stride = hd + 2u;
    let row = ROWS[head.y];
    let n_splits = row_splits(row);
    if (n_splits == 1u) {
        return;
    }
    let first = row.part + head.x * n_splits * stride;
    var m = EMPTY;
    for (var s = lid; s < n_splits; s += WG) {
        m = max(m, PART[first + s * stride + hd]);
    }
    m = workgroup_reduce(m, lid, true);
    var total = 0.0;
    for (var s = lid; s < n_splits; s += WG) {
        let at = first + s * stride;
        let w = exp(PART[at + hd] - m);
        weight[s] = w;
        total += PART[at + hd + 1u] * w;
    }
    total = workgroup_reduce(total, lid, false);
    let out = (head.y * P.n_head + head.x) * hd;
    for (var d = lid; d < hd; d += WG) {
        // four partials loaded before they are used: the loop is bound by load latency, not work
        var sum = vec4<f32>(0.0);
        var s = 0u;
        for (; s + 4u <= n_splits; s += 4u) {
            let at = first + s * stride + d;
            let v = vec4<f32>(PART[at], PART[at + stride], PART[at + 2u * stride], PART[at + 3u * stride]);
            sum += v * vec4<f32>(weight[s], weight[s + 1u], weight[s + 2u], weight[s + 3u]);
        }
        for (; s < n_splits; s++) {
            sum.x += PART[first + s * stride + d] * weight[s];
        }
        OUT[out + d] = dot(sum, vec4<f32>(1.0)) / total;
    }
}
