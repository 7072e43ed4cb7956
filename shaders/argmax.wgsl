// Greedy decoding on the GPU: the id of the largest logit, in two dispatches of this program.
// Stage 1 ({ARGMAX_STAGE} = 1): workgroup g reduces logits [g * PER, (g + 1) * PER) to one candidate.
// Stage 2 ({ARGMAX_STAGE} = 2): one workgroup reduces the candidates and writes the id into TOKENS[0],
// the input of the next token's embedding, and into RING[n_past], the ids the host reads back.
// Same answer as numpy's argmax: ties go to the lowest id, a NaN counts as larger than anything
// (so the first NaN wins), -0.0 equals +0.0, -inf is a value like any other.

struct Params {
    n: u32,          // logits (the vocabulary size)
    n_groups: u32,   // stage-1 workgroups: ceil(n / PER)
    ring_len: u32,   // positions RING holds (the context size)
}

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> LOGITS: array<f32>;                 // (n,)
@group(0) @binding(1) var<storage, read_write> CAND: array<vec2<u32>>;       // (n_groups,) (key, id)
@group(0) @binding(2) var<storage, read_write> TOKENS: array<u32>;          // the token ids buffer
@group(0) @binding(3) var<storage, read_write> RING: array<u32>;            // (ring_len,) chosen id by position
@group(0) @binding(4) var<uniform> P: Params;
@group(0) @binding(5) var<uniform> S: Step;

const STAGE: u32 = {ARGMAX_STAGE}u;
const WG: u32 = 256u;
const ITEMS: u32 = 8u;               // logits per invocation in stage 1
const PER: u32 = WG * ITEMS;         // logits per stage-1 workgroup
const NONE: vec2<u32> = vec2<u32>(0u, 0xFFFFFFFFu);  // loses to every real logit (-inf has key 0x007FFFFF)

var<workgroup> best: array<vec2<u32>, WG>;

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

// The better of two (key, id) candidates: the larger key, the lower id among equal keys.
fn better(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    if (b.x > a.x || (b.x == a.x && b.y < a.y)) {
        return b;
    }
    return a;
}

fn reduce(lid: u32, mine: vec2<u32>) -> vec2<u32> {
    best[lid] = mine;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            best[lid] = better(best[lid], best[lid + stride]);
        }
        workgroupBarrier();
    }
    return best[0];
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    var mine = NONE;
    if (STAGE == 1u) {
        // ids visited in increasing order, so a strict comparison keeps the lowest id among ties
        let first = wid.x * PER;
        for (var k = 0u; k < ITEMS; k++) {
            let i = first + k * WG + lid;
            if (i < P.n) {
                mine = better(mine, vec2<u32>(order_key(LOGITS[i]), i));
            }
        }
        let winner = reduce(lid, mine);
        if (lid == 0u) {
            CAND[wid.x] = winner;
        }
        return;
    }
    for (var g = lid; g < P.n_groups; g += WG) {
        mine = better(mine, CAND[g]);
    }
    let winner = reduce(lid, mine);
    if (lid == 0u) {
        TOKENS[0] = winner.y;
        if (S.n_past < P.ring_len) {
            RING[S.n_past] = winner.y;
        }
    }
}
