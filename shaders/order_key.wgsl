// Floats as u32 keys whose integer order is the float order (argmax.wgsl, candidates.wgsl).

// A u32 whose order is the float order: negative floats flipped, positive ones above them.
fn order_key(x: f32) -> u32 {
    var bits = bitcast<u32>(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0xFFFFFFFFu;  // NaN: above +inf
    }
    if (bits == 0x80000000u) {
        bits = 0u;  // -0.0 ties with +0.0
    }
    if ((bits & 0x80000000u) != 0u) {
        return ~bits;
    }
    return bits | 0x80000000u;
}
