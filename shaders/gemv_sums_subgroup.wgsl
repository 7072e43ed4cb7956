// Workgroup totals of each invocation's partial sums `part` (gemv_common.wgsl) for the typed decode
// matmuls: subgroupAdd inside each subgroup, then one step through workgroup memory. Assumes
// subgroups are consecutive runs of at least 4 invocations (NVIDIA 32, AMD 32/64, Intel 8-32, Mesa 8).
// After workgroup_sums(lid, n), totals[0..n) hold the sums of part[0..n) over the workgroup.

const MAX_SUBGROUPS: u32 = (WG + 3u) / 4u;

var<workgroup> subgroup_sums: array<f32, N_SUMS * MAX_SUBGROUPS>;
var<workgroup> totals: array<f32, N_SUMS>;

fn workgroup_sums(lid: u32, n: u32) {
    let size = subgroupAdd(1u);
    let first = lid % size == 0u;
    let at = (lid / size) * N_SUMS;
    for (var j = 0u; j < n; j++) {
        let total = subgroupAdd(part[j]);
        if (first) {
            subgroup_sums[at + j] = total;
        }
    }
    workgroupBarrier();
    if (lid < n) {
        var sum = 0.0;
        for (var s = 0u; s < WG / size; s++) {
            sum += subgroup_sums[s * N_SUMS + lid];
        }
        totals[lid] = sum;
    }
    workgroupBarrier();
}
