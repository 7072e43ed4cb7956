// y = W x for decode: TOKENS tokens per workgroup (wid.y picks the group of tokens), 1 for batch-1
// decode, up to 4 for a batch of conversations, so each weight is read once for all of them (a batch
// of 8 is two groups, whose workgroups read the same rows at about the same time).
// W stays quantized. A workgroup of 256 invocations makes ROWS_WG output rows, 4 at a time (gated:
// 4 gate rows and their 4 up rows): the workgroup's subgroups share the row quads, and when there
// are more subgroups than quads (small matrices, so that the rows spread over many workgroups)
// several subgroups take one quad and split its units between them. A subgroup's lanes stride over
// the units (UNIT weights each, decoded by gemv/{GEMV_UNIT}.wgsl), keep 4 partial sums in a vec4
// and add them across the subgroup (lanes_{REDUCE}.wgsl); the subgroups of a quad then meet once
// in workgroup memory, every token's at once between one pair of barriers. The unit's x is read
// once for the 4 rows: from X by the float units, and by the quantized types' units from workgroup
// memory, where the workgroup rounds each token's x once, a chunk of the row at a time
// (gemv/x_int8.wgsl).
// Each token has its own sums, made by one call of add_unit per token written out (TOKENS is a
// constant, so the calls it does not reach are removed).
// MODE fusions (activation.wgsl): RMSNorm of the input (every subgroup reads its share of x anyway,
// so the sum of squares costs no extra pass; 1/rms applied to the sums), gated activation, residual
// add; up to three weight segments (e.g. attn_q, attn_k, attn_v of one type) make one output.
// MODE_ROUND_OUT (the gated FFN, before a quantized ffn_down): the workgroup also rounds its output
// rows, 16 at a time, as gemv/x_int8.wgsl would round them as x, and stores them in Y from
// P.xq_off on, each token's P.rows / 16 blocks after the last's; ffn_down then reads them (its
// STAGE_X 2) instead of rounding each block once per workgroup.

#include "matmul_structs.wgsl"

@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = 256u;
const ROWS_WG: u32 = {GEMV_ROWS_WG}u;  // output rows per workgroup: 4 to 32, a batch's up to 4 times as many
const QUADS: u32 = ROWS_WG / 4u;
// the quads a one-token workgroup has, which `split` is reckoned from: a batch's taller workgroups
// split each row's units between subgroups as one token's do, so a token's sums keep their bits
const SPLIT_QUADS: u32 = {GEMV_SPLIT_QUADS}u;
const TOKENS: u32 = {GEMV_TOKENS}u;     // tokens per workgroup: 1 to 4
// the op's mode (P.mode) as a constant, so that the compiler drops what the mode does not use:
// the up rows' sums, the squares, their registers
const MODE: u32 = {GEMV_MODE}u;

const ROUND_OUT: bool = (MODE & MODE_ROUND_OUT) != 0u;

var<private> quad_row: u32;  // the first of the 4 rows this invocation sums (a unit mixing types reads it)

#include "activation.wgsl"
#include "gemv_common.wgsl"
#include "gemv/x_round.wgsl"
#include "lanes_{REDUCE}.wgsl"
// binding 0 (W), UNIT, XU, unit_x and unit_rows come from the unit file, and from the x file it
// includes (gemv/x_float.wgsl or gemv/x_int8.wgsl) chunk_units, stage_x and token_x
#include "gemv/{GEMV_UNIT}.wgsl"

const SUBS: u32 = {GEMV_SUBGROUPS}u;  // subgroups a workgroup may have: WG / the least subgroup size
// each (token, subgroup)'s sums of its quad: a | b | sq
var<workgroup> partial: array<vec4<f32>, 3u * SUBS * TOKENS>;
// MODE_ROUND_OUT: each token's output rows of the workgroup, for their rounding
var<workgroup> y_round: array<f32, {GEMV_ROUND_FLOATS}u>;

// first word of each of the 4 rows from `row` on (rows past the end repeat the last one); with
// `up`, of the up-projection rows paired with them (MODE_GATED)
fn row_words(row: u32, up: bool) -> vec4<u32> {
    let ids = min(vec4<u32>(row) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(P.rows - 1u));
    if (up) {
        return vec4<u32>(P.w1) + ids * P.row_words;
    }
    return vec4<u32>(row_base(ids.x), row_base(ids.y), row_base(ids.z), row_base(ids.w));
}

// rows row..row+3 of the token; with MODE_ROUND_OUT also into y_round from `kept` on
fn write_rows(row: u32, token: u32, a: vec4<f32>, b: vec4<f32>, sq: f32, kept: u32) {
    var inv = 1.0;
    if ((MODE & MODE_NORM) != 0u) {
        inv = inverseSqrt(sq / f32(P.cols) + P.eps);
    }
    for (var r = 0u; r < 4u; r++) {
        if (row + r < P.rows) {
            let y = write_y(MODE, token * P.y_stride + P.y_off + row + r, a[r], b[r], inv);
            if (ROUND_OUT) {
                y_round[kept + r] = y;
            }
        }
    }
}

fn y_round_vec4(at: u32) -> vec4<f32> {
    return vec4<f32>(y_round[at], y_round[at + 1u], y_round[at + 2u], y_round[at + 3u]);
}

// MODE_ROUND_OUT: the workgroup's rows from row0 of each token, 16 at a time, rounded and stored
// (P.rows is a multiple of 16 and ROWS_WG of 16: a block's rows are all there or none)
fn round_out(row0: u32, first_token: u32, n_tokens: u32, lid: u32) {
    let blocks = ROWS_WG / 16u;
    let t = lid / blocks;
    let row = row0 + 16u * (lid % blocks);
    if (t < n_tokens && row < P.rows) {
        let at = t * ROWS_WG + row - row0;
        let r = round16(X16(mat4x4<f32>(y_round_vec4(at), y_round_vec4(at + 4u), y_round_vec4(at + 8u),
                                        y_round_vec4(at + 12u)), 0.0));
        let out = P.xq_off + ((first_token + t) * P.rows + row) / 2u;  // 8 floats a block
        let s = x8_scales(r);
        for (var c = 0u; c < 4u; c++) {
            Y[out + c] = bitcast<f32>(r.q[c]);
            Y[out + 4u + c] = s[c];
        }
    }
}

// one token's sums over the units of 4 rows (a) and of their up rows (b, MODE_GATED), and the
// sum of squares of its x (MODE_NORM)
struct Sums {
    a: vec4<f32>,
    b: vec4<f32>,
    sq: f32,
}

fn add_unit(s: ptr<function, Sums>, x: u32, a: vec4<u32>, b: vec4<u32>, u: u32, gated_mode: bool) {
    let xu = unit_x(x, u);
    (*s).sq += xu.sq;
    (*s).a += unit_rows(a, u, xu);
    if (gated_mode) {
        (*s).b += unit_rows(b, u, xu);
    }
}

// token t's sums added across the subgroup and put in workgroup memory for the merge; the up rows'
// sums and the squares only where the mode has them
fn share(s: Sums, t: u32, sub: u32, lane: u32, lid: u32) {
    let total_a = lanes_sum4(s.a, lid);
    var total_b = vec4<f32>(0.0);
    if ((MODE & MODE_GATED) != 0u) {
        total_b = lanes_sum4(s.b, lid);
    }
    var total_sq = 0.0;
    if ((MODE & MODE_NORM) != 0u) {
        total_sq = lanes_sum1(s.sq, lid);
    }
    if (lane == 0u) {
        let at = 3u * (t * SUBS + sub);
        partial[at] = total_a;
        partial[at + 1u] = total_b;
        partial[at + 2u] = vec4<f32>(total_sq);
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let lanes = lane_count();
    let lane = lid % lanes;
    let sub = lid / lanes;
    let n_sub = WG / lanes;
    let n_units = P.cols / UNIT;
    // subgroups per quad: as many as the workgroup has to spare, but each lane with a unit
    let split = max(1u, min(n_sub / SPLIT_QUADS, (n_units + lanes - 1u) / lanes));
    let per_pass = max(1u, n_sub / split);   // quads made at once
    let first_token = wid.y * TOKENS;
    let n_tokens = min(TOKENS, S.n_tokens - first_token);
    let gated_mode = (MODE & MODE_GATED) != 0u;
    let chunk = chunk_units(n_units);
    for (var first = 0u; first < QUADS; first += per_pass) {
        let quad = first + sub / split;
        let row = wid.x * ROWS_WG + 4u * quad;
        let busy = sub / split < per_pass && quad < QUADS && row < P.rows;
        quad_row = row;
        let a = row_words(row, false);
        let b = row_words(row, true);
        // zero for every pass: wgpu 0.32's naga keeps a loop's `var` without an initializer from
        // one iteration to the next (gfx-rs/wgpu#9489)
        var s0 = Sums();
        var s1 = Sums();
        var s2 = Sums();
        var s3 = Sums();
        // each lane's units are the same whatever the chunks, so a token's sums are too
        var u = (sub % split) * lanes + lane;
        for (var u0 = 0u; u0 < n_units; u0 += chunk) {
            if (u0 > 0u) {
                workgroupBarrier();  // every unit of the chunk before has read the staged x
            }
            stage_x(first_token, n_tokens, u0, lid);
            // where the group's tokens find their x; past the last token, the last one again (not written)
            let x0 = token_x(0u, first_token, u0);
            let x1 = token_x(min(1u, n_tokens - 1u), first_token, u0);
            let x2 = token_x(min(2u, n_tokens - 1u), first_token, u0);
            let x3 = token_x(min(3u, n_tokens - 1u), first_token, u0);
            let end = min(n_units, u0 + chunk);
            for (; busy && u < end; u += split * lanes) {
                add_unit(&s0, x0, a, b, u, gated_mode);
                if (TOKENS > 1u) {
                    add_unit(&s1, x1, a, b, u, gated_mode);
                }
                if (TOKENS > 2u) {
                    add_unit(&s2, x2, a, b, u, gated_mode);
                }
                if (TOKENS > 3u) {
                    add_unit(&s3, x3, a, b, u, gated_mode);
                }
            }
        }
        workgroupBarrier();  // the previous pass's merge has read `partial`
        share(s0, 0u, sub, lane, lid);
        if (TOKENS > 1u) {
            share(s1, 1u, sub, lane, lid);
        }
        if (TOKENS > 2u) {
            share(s2, 2u, sub, lane, lid);
        }
        if (TOKENS > 3u) {
            share(s3, 3u, sub, lane, lid);
        }
        workgroupBarrier();
        // invocation i < per_pass * n_tokens adds the sums of quad first + i % per_pass of token
        // i / per_pass over its subgroups and writes them
        let t = lid / per_pass;
        let q = first + lid % per_pass;
        if (t < n_tokens && q < QUADS && wid.x * ROWS_WG + 4u * q < P.rows) {
            var a = vec4<f32>(0.0);
            var b = vec4<f32>(0.0);
            var s = 0.0;
            for (var k = 0u; k < split; k++) {
                let at = 3u * (t * SUBS + (q - first) * split + k);
                a += partial[at];
                b += partial[at + 1u];
                s += partial[at + 2u].x;
            }
            write_rows(wid.x * ROWS_WG + 4u * q, first_token + t, a, b, s, t * ROWS_WG + 4u * q);
        }
    }
    if (ROUND_OUT) {
        workgroupBarrier();  // every row is in y_round
        round_out(wid.x * ROWS_WG, first_token, n_tokens, lid);
    }
}
