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
