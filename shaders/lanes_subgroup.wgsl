// Sums across the lanes of a subgroup (subgroupAdd), for kernels where each subgroup makes its own
// outputs. Assumes subgroups are consecutive runs of invocations (true on the drivers we run:
// NVIDIA, Mesa, AMD, Intel), so lane = local index % lane_count().

fn lane_count() -> u32 {
    return subgroupAdd(1u);
}

fn lanes_sum4(v: vec4<f32>, lid: u32) -> vec4<f32> {
    return subgroupAdd(v);
}

fn lanes_sum1(v: f32, lid: u32) -> f32 {
    return subgroupAdd(v);
}

fn lanes_max4(v: vec4<f32>, lid: u32) -> vec4<f32> {
    return subgroupMax(v);
}
