// Streaming-read probe for `airframe bench`: every invocation sums a strided run of vec4<u32>
// words, so the buffer is read once, coalesced; the sums land in OUT so nothing is optimized away.

struct Params {
    n_vec4: u32,     // vec4 words in SRC
    n_threads: u32,  // invocations in the grid
}

@group(0) @binding(0) var<storage, read> SRC: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let thread = gid.x;
    var acc = vec4<u32>(0u);
    for (var i = thread; i < P.n_vec4; i += P.n_threads) {
        acc ^= SRC[i];
    }
    OUT[thread] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
