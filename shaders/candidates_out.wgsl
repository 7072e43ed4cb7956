// What candidates.wgsl writes for one token and draw.wgsl completes; the host reads it back whole
// (airframe/gpu/candidates.py).

const PEN_MAX: u32 = 1024u;   // penalty table entries
const CAP: u32 = 2048u;       // candidates written at most

struct Out {
    count: atomic<u32>,    // candidates found; only the first CAP were written
    threshold: u32,        // the smallest order key of a candidate's bin
    non_finite: u32,       // 1 when a logit after the penalties is NaN or infinite
    max_logit: f32,
    log_sum_exp: f32,      // of every logit after the penalties
    drawn: u32,            // draw.wgsl: the token it picked (0 when it could not)
    decided: u32,          // draw.wgsl: 1 when it could pick one
    pad: u32,
    raw: array<f32, PEN_MAX>,     // the logits the penalties overwrote, by table entry
    cand: array<vec2<u32>, CAP>,  // (token id, logit bits after the penalties)
}
