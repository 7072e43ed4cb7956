// Greedy decoding on the GPU: the id of the largest logit of each logits row (wid.y: one row for a
// chained token, one per conversation of a decode batch), in two dispatches of this program.
// Stage 1 ({ARGMAX_STAGE} = 1): workgroup g reduces logits [g * PER, (g + 1) * PER) of its row to
// one candidate. Stage 2 ({ARGMAX_STAGE} = 2): one workgroup per row reduces its candidates and
// writes the id into TOKENS[row], the input of the next forward's embedding, and into
// RING[n_past + row], the ids the host reads back.
// Same answer as numpy's argmax: ties go to the lowest id, a NaN counts as larger than anything
// (so the first NaN wins), -0.0 equals +0.0, -inf is a value like any other. The ring's id has its
// top bit set (NON_FINITE) when any logit was NaN or infinite: the host then reports damage.

struct Params {
    n: u32,          // logits (the vocabulary size)
    n_groups: u32,   // stage-1 workgroups per row: ceil(n / PER)
    ring_len: u32,   // ids RING holds (a chain: the context size; a decode batch: its rows)
}

#include "step.wgsl"
#include "order_key.wgsl"

@group(0) @binding(0) var<storage, read> LOGITS: array<f32>;                 // (rows, n)
@group(0) @binding(1) var<storage, read_write> CAND: array<vec4<u32>>;       // (rows, n_groups) key, id, non-finite seen
@group(0) @binding(2) var<storage, read_write> TOKENS: array<u32>;          // the token ids buffer
@group(0) @binding(3) var<storage, read_write> RING: array<u32>;            // (ring_len,) chosen id by position or row
@group(0) @binding(4) var<uniform> P: Params;
@group(0) @binding(5) var<uniform> S: Step;

const STAGE: u32 = {ARGMAX_STAGE}u;
const WG: u32 = 256u;
const ITEMS: u32 = 8u;               // logits per invocation in stage 1
const PER: u32 = WG * ITEMS;         // logits per stage-1 workgroup
const NONE: vec2<u32> = vec2<u32>(0u, 0xFFFFFFFFu);  // loses to every real logit (-inf has key 0x007FFFFF)
const NON_FINITE: u32 = 2147483648u;  // the top bit of a ring id

var<workgroup> best: array<vec2<u32>, WG>;
var<workgroup> group_bad: atomic<u32>;

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
    if (lid == 0u) {
        atomicStore(&group_bad, 0u);
    }
    workgroupBarrier();
    let row = wid.y;
    if (STAGE == 1u) {
        // ids visited in increasing order, so a strict comparison keeps the lowest id among ties
        let first = wid.x * PER;
        for (var k = 0u; k < ITEMS; k++) {
            let i = first + k * WG + lid;
            if (i < P.n) {
                let x = LOGITS[row * P.n + i];
                mine = better(mine, vec2<u32>(order_key(x), i));
                if ((bitcast<u32>(x) & 0x7F800000u) == 0x7F800000u) {
                    atomicOr(&group_bad, 1u);
                }
            }
        }
        let winner = reduce(lid, mine);  // its barriers also publish group_bad
        if (lid == 0u) {
            CAND[row * P.n_groups + wid.x] = vec4<u32>(winner, atomicLoad(&group_bad), 0u);
        }
        return;
    }
    for (var g = lid; g < P.n_groups; g += WG) {
        let c = CAND[row * P.n_groups + g];
        mine = better(mine, c.xy);
        if (c.z != 0u) {
            atomicOr(&group_bad, 1u);
        }
    }
    let winner = reduce(lid, mine);
    if (lid == 0u) {
        TOKENS[row] = winner.y;
        if (S.n_past + row < P.ring_len) {
            RING[S.n_past + row] = winner.y | select(0u, NON_FINITE, atomicLoad(&group_bad) != 0u);
        }
    }
}
