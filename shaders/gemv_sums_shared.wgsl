// Workgroup totals of each invocation's partial sums `part` (gemv_common.wgsl) for the typed decode
// matmuls, through workgroup memory only (devices without subgroups): one tree per value.
// After workgroup_sums(lid, n), totals[0..n) hold the sums of part[0..n) over the workgroup.

var<workgroup> tree: array<f32, WG>;
var<workgroup> totals: array<f32, N_SUMS>;

fn workgroup_sums(lid: u32, n: u32) {
    for (var j = 0u; j < n; j++) {
        workgroupBarrier();
        tree[lid] = part[j];
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (lid < stride) {
                tree[lid] += tree[lid + stride];
            }
            workgroupBarrier();
        }
        if (lid == 0u) {
            totals[j] = tree[0];
        }
    }
    workgroupBarrier();
}
