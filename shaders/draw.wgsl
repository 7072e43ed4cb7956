// One sampled token drawn on the GPU from candidates.wgsl's candidates, by the host's sampler chain
// (airframe/sampling.py, Sampler.sample_reduced) in float32: top-k, top-p, min-p, temperature, then
// the cumulative distribution over the survivors in ascending id order inverted at P.u. The token
// goes to TOKENS[P.row], the next forward's input (a decode batch's row P.row), and to OUT.drawn; the host checks it with its float64
// chain when it reads OUT back and runs the token again where the two differ (airframe/gpu/sampled.py).
// One workgroup: the candidates are ranked by (logit down, id up) by counting, so at most MAX of
// them; with more, or when the candidates cannot tell (top-p or min-p reach below them), OUT.decided
// is 0 and the host decides.

#include "candidates_out.wgsl"

struct Params {
    top_k: u32,         // 0: off
    top_p: f32,         // 1: off
    min_p: f32,         // 0: off
    temperature: f32,   // 0: greedy (the highest logit, the lowest id among ties)
    u: f32,             // this token's random number in [0, 1)
    row: u32,           // the row of TOKENS the token goes to
}

@group(0) @binding(0) var<storage, read_write> OUT: Out;
@group(0) @binding(1) var<storage, read_write> TOKENS: array<u32>;  // [row]: the next forward's input
@group(0) @binding(2) var<uniform> P: Params;

const WG: u32 = 256u;
const MAX: u32 = 1024u;            // candidates ranked at most
const LOWEST: f32 = -3.4e38;

var<workgroup> ids: array<u32, MAX>;          // the candidates as found, then the survivors by id
var<workgroup> vals: array<f32, MAX>;
var<workgroup> sorted_ids: array<u32, MAX>;   // by logit, down
var<workgroup> sorted_vals: array<f32, MAX>;
var<workgroup> shared_count: u32;

// the smallest float whose order key (order_key.wgsl) is at least `key`
fn key_floor(key: u32) -> f32 {
    if (key == 0u) {
        return LOWEST;
    }
    return bitcast<f32>(select(~key, key & 0x7FFFFFFFu, (key & 0x80000000u) != 0u));
}

fn finish(token: u32, decided: bool) {
    OUT.drawn = token;
    OUT.decided = select(0u, 1u, decided);
    TOKENS[P.row] = token;  // 0 when undecided: a valid id for the forward the host will discard
}

// how many of the n sorted candidates top-k, top-p and min-p keep; 0: the candidates cannot tell
fn survivors(n: u32) -> u32 {
    let v0 = sorted_vals[0];
    var m = n;
    if (P.top_k > 0u) {
        m = min(m, P.top_k);
    }
    if (P.top_p < 1.0) {
        var total = 0.0;  // with top-k, top-p shares out the k kept; without, the whole vocabulary
        for (var i = 0u; i < m; i++) {
            total += exp(sorted_vals[i] - v0);
        }
        var reach = 0.0;
        var keep = 0u;
        for (var i = 0u; i < m; i++) {
            if (P.top_k > 0u) {
                reach += exp(sorted_vals[i] - v0) / total;
            } else {
                reach += exp(sorted_vals[i] - OUT.log_sum_exp);
            }
            if (reach >= P.top_p) {
                keep = i + 1u;
                break;
            }
        }
        if (keep == 0u) {
            if (P.top_k == 0u) {
                return 0u;  // the tokens that reach top_p go on below the candidates
            }
            keep = m;
        }
        m = keep;
    } else if (P.top_k == 0u && v0 + log(P.min_p) <= key_floor(OUT.threshold)) {
        return 0u;  // min-p keeps tokens below the candidates
    }
    if (P.min_p > 0.0) {
        let floor = log(P.min_p);
        var keep = 1u;
        while (keep < m && sorted_vals[keep] - v0 >= floor) {
            keep++;
        }
        m = keep;
    }
    return m;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    if (lid == 0u) {
        let count = atomicLoad(&OUT.count);
        shared_count = select(count, 0u, OUT.non_finite != 0u || count > MAX);
    }
    let n = workgroupUniformLoad(&shared_count);
    if (n == 0u) {
        if (lid == 0u) {
            finish(0u, false);
        }
        return;
    }
    for (var i = lid; i < n; i += WG) {
        let c = OUT.cand[i];
        ids[i] = c.x;
        vals[i] = bitcast<f32>(c.y);
    }
    workgroupBarrier();
    for (var i = lid; i < n; i += WG) {
        let id = ids[i];
        let v = vals[i];
        var rank = 0u;
        for (var j = 0u; j < n; j++) {
            let w = vals[j];
            rank += select(0u, 1u, w > v || (w == v && ids[j] < id));
        }
        sorted_ids[rank] = id;
        sorted_vals[rank] = v;
    }
    workgroupBarrier();
    if (lid == 0u) {
        shared_count = select(survivors(n), 1u, P.temperature == 0.0);
    }
    let m = workgroupUniformLoad(&shared_count);
    if (m == 0u) {
        if (lid == 0u) {
            finish(0u, false);
        }
        return;
    }
    for (var i = lid; i < m; i += WG) {
        let id = sorted_ids[i];
        var rank = 0u;
        for (var j = 0u; j < m; j++) {
            rank += select(0u, 1u, sorted_ids[j] < id);
        }
        ids[rank] = id;
        vals[rank] = sorted_vals[i];
    }
    workgroupBarrier();
    if (lid == 0u) {
        if (m == 1u) {
            finish(ids[0], true);
            return;
        }
        let v0 = sorted_vals[0];
        var total = 0.0;
        for (var i = 0u; i < m; i++) {
            total += exp((vals[i] - v0) / P.temperature);
        }
        let at = P.u * total;
        var reach = 0.0;
        var pick = m - 1u;
        for (var i = 0u; i < m; i++) {
            reach += exp((vals[i] - v0) / P.temperature);
            if (reach > at) {
                pick = i;
                break;
            }
        }
        finish(ids[pick], true);
    }
}
