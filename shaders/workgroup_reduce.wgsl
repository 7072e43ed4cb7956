// The sum (or the maximum) of one float per invocation over the workgroup, through workgroup
// memory; every invocation gets it. The includer defines `const WG: u32`, a power of two.

var<workgroup> partial: array<f32, WG>;

fn workgroup_reduce(v: f32, lid: u32, is_max: bool) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            let a = partial[lid];
            let b = partial[lid + stride];
            partial[lid] = select(a + b, max(a, b), is_max);
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();  // read by every invocation before the next call writes
    return total;
}

fn workgroup_sum(v: f32, lid: u32) -> f32 {
    return workgroup_reduce(v, lid, false);
}
