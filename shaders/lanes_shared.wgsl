// lanes_subgroup.wgsl without the subgroup feature: runs of LANES invocations summed through
// workgroup memory. Every invocation of the workgroup must call each sum (they hold barriers).
// The includer defines `const WG: u32`, a multiple of LANES.

const LANES: u32 = 32u;

var<workgroup> lane_parts: array<vec4<f32>, WG>;

fn lane_count() -> u32 {
    return LANES;
}

fn lanes_sum4(v: vec4<f32>, lid: u32) -> vec4<f32> {
    workgroupBarrier();  // the previous sum has been read
    lane_parts[lid] = v;
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride /= 2u) {
        if (lid % LANES < stride) {
            lane_parts[lid] += lane_parts[lid + stride];
        }
        workgroupBarrier();
    }
    return lane_parts[lid - lid % LANES];
}

fn lanes_sum1(v: f32, lid: u32) -> f32 {
    return lanes_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), lid).x;
}
