// Workgroup sums of two vec4 per invocation: subgroupAdd inside each subgroup, then one step through
// workgroup memory. Assumes subgroups are consecutive runs of invocations (true on the drivers we
// run: NVIDIA, Mesa, AMD, Intel). After reduce_pair(a, b, lid), every invocation may read the totals
// in sum_a[0] and sum_b[0]. The includer defines `const WG: u32`.

var<workgroup> sum_a: array<vec4<f32>, WG>;
var<workgroup> sum_b: array<vec4<f32>, WG>;

fn reduce_pair(a: vec4<f32>, b: vec4<f32>, lid: u32) {
    let total_a = subgroupAdd(a);
    let total_b = subgroupAdd(b);
    let size = subgroupAdd(1u);
    workgroupBarrier();
    if (lid % size == 0u) {
        sum_a[lid] = total_a;
        sum_b[lid] = total_b;
    }
    workgroupBarrier();
    if (lid == 0u) {
        for (var s = size; s < WG; s += size) {
            sum_a[0] += sum_a[s];
            sum_b[0] += sum_b[s];
        }
    }
    workgroupBarrier();
}

var<workgroup> sum_c: array<f32, WG>;

// reduce_pair plus one scalar (gemv_chunk.wgsl's sum of x^2 for its fused RMSNorm), total in sum_c[0].
fn reduce_three(a: vec4<f32>, b: vec4<f32>, c: f32, lid: u32) {
    let total_a = subgroupAdd(a);
    let total_b = subgroupAdd(b);
    let total_c = subgroupAdd(c);
    let size = subgroupAdd(1u);
    workgroupBarrier();
    if (lid % size == 0u) {
        sum_a[lid] = total_a;
        sum_b[lid] = total_b;
        sum_c[lid] = total_c;
    }
    workgroupBarrier();
    if (lid == 0u) {
        for (var s = size; s < WG; s += size) {
            sum_a[0] += sum_a[s];
            sum_b[0] += sum_b[s];
            sum_c[0] += sum_c[s];
        }
    }
    workgroupBarrier();
}
