// The sum of one float per invocation over the workgroup, through workgroup memory (every
// invocation gets it). The includer defines `const WG: u32`, a power of two.

var<workgroup> partial: array<f32, WG>;

fn workgroup_sum(v: f32, lid: u32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();  // read by every invocation before the next call writes
    return total;
}
