// lanes_subgroup.wgsl without the subgroup feature: runs of LANES invocations summed (or their
// maximum taken) through workgroup memory. Every invocation of the workgroup must call each sum (they hold barriers).
// The includer defines `const WG: u32`, a multiple of LANES.

const LANES: u32 = 32u;

var<workgroup> lane_parts: array<vec4<f32>, WG>;

fn lane_count() -> u32 {
    return LANES;
}

fn lanes_fold(v: vec4<f32>, lid: u32, is_max: bool) -> vec4<f32> {
    workgroupBarrier();  // the previous result has been read
    lane_parts[lid] = v;
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride /= 2u) {
        if (lid % LANES < stride) {
            let a = lane_parts[lid];
            let b = lane_parts[lid + stride];
            lane_parts[lid] = select(a + b, max(a, b), is_max);
        }
        workgroupBarrier();
    }
    return lane_parts[lid - lid % LANES];
}

fn lanes_sum4(v: vec4<f32>, lid: u32) -> vec4<f32> {
    return lanes_fold(v, lid, false);
}

fn lanes_sum1(v: f32, lid: u32) -> f32 {
    return lanes_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), lid).x;
}

fn lanes_max4(v: vec4<f32>, lid: u32) -> vec4<f32> {
    return lanes_fold(v, lid, true);
}
