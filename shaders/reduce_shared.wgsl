// Workgroup sums of two vec4 per invocation through workgroup memory only (no subgroup feature).
// After reduce_pair(a, b, lid), every invocation may read the totals in sum_a[0] and sum_b[0].
// The includer defines `const WG: u32` (a power of two).

var<workgroup> sum_a: array<vec4<f32>, WG>;
var<workgroup> sum_b: array<vec4<f32>, WG>;

fn reduce_pair(a: vec4<f32>, b: vec4<f32>, lid: u32) {
    workgroupBarrier();
    sum_a[lid] = a;
    sum_b[lid] = b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            sum_a[lid] += sum_a[lid + stride];
            sum_b[lid] += sum_b[lid + stride];
        }
        workgroupBarrier();
    }
}

var<workgroup> sum_c: array<f32, WG>;

// reduce_pair plus one scalar (gemv_chunk.wgsl's sum of x^2 for its fused RMSNorm), total in sum_c[0].
fn reduce_three(a: vec4<f32>, b: vec4<f32>, c: f32, lid: u32) {
    workgroupBarrier();
    sum_a[lid] = a;
    sum_b[lid] = b;
    sum_c[lid] = c;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            sum_a[lid] += sum_a[lid + stride];
            sum_b[lid] += sum_b[lid + stride];
            sum_c[lid] += sum_c[lid + stride];
        }
        workgroupBarrier();
    }
}
