// Causal grouped-query attention of a prefill chunk over the K/V cache (which already holds the
// chunk's own keys, written by rope.wgsl): flash attention, https://arxiv.org/abs/2205.14135.
// Workgroup (row block, kv head): 64 query rows, row r = (token r / GROUP, query head r % GROUP of
// the K/V group), so every K and V tile serves all heads of the group. Per tile of KEYS positions:
// S = Q K^T by chunks of 16 head dims (Q and K chunks staged in workgroup memory, transposed so the
// inner loop reads vec4), an online softmax per row, then O += P V by blocks of 64 head dims.
// Invocation (tr, tc) owns rows 4 tr .. 4 tr + 3: their S at keys tc * KEYS / 16 .., their O at
// dims 64 j + 4 tc .. + 3.

#include "attention_params.wgsl"

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> QKV: array<vec4<f32>>;     // (tokens, (n_q + 2 n_kv) / 4), Q rotated
@group(0) @binding(1) var<storage, read> KV: array<vec4<f32>>;      // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;     // (tokens, n_head * head_dim)
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim, a multiple of 4
const KEYS: u32 = {ATTN_KEYS}u;       // keys per tile: 32 or 64
const ROWS: u32 = 64u;                // query rows per workgroup
const KC: u32 = 16u;                  // head dims per S chunk
const DB: u32 = (HD + 63u) / 64u;     // blocks of 64 head dims
const SC: u32 = KEYS / 16u;           // S columns per invocation
const HD4: u32 = HD / 4u;
const EMPTY: f32 = -1.0e30;           // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs

var<workgroup> qs: array<vec4<f32>, KC * 16u>;        // (dim, row quad): the Q chunk
var<workgroup> ks: array<vec4<f32>, KC * KEYS / 4u>;  // (dim, key quad): the K chunk
var<workgroup> ps: array<vec4<f32>, KEYS * 16u>;      // (key, row quad): probabilities
var<workgroup> vs: array<vec4<f32>, KEYS * 16u>;      // (key, dim quad): a block of V
var<workgroup> row_max: array<f32, ROWS * 16u>;       // (row, tc): the tile's maxima

// Query row r of this workgroup: (token, head), token == n_tokens when past the chunk
fn row_of(block: u32, r: u32) -> vec2<u32> {
    let index = block * ROWS + r;
    return vec2<u32>(min(index / GROUP, S.n_tokens), index % GROUP);
}

fn visible(pos: u32, key: u32) -> bool {
    return key <= pos && (P.window == 0u || pos - key < P.window);
}

// The Q and K chunks of head dims d0 .. d0 + KC: each invocation loads whole vec4 of dims (4 dims
// of a row or of a key) and stores them transposed, one float into each of 4 dims' runs.
fn load_chunk(lid: u32, block: u32, kv_head: u32, key0: u32, d0: u32) {
    let d4 = d0 / 4u + lid % (KC / 4u);
    for (var i = lid; i < ROWS * KC / 4u; i += 256u) {   // (row, dim quad) of Q
        let r = i / (KC / 4u);
        let row = row_of(block, r);
        let t = min(row.x, S.n_tokens - 1u);
        var v = vec4<f32>(0.0);
        if (d4 < HD4) {
            v = QKV[t * P.qkv_stride / 4u + (kv_head * GROUP + row.y) * HD4 + d4] * P.scale;
        }
        let base = (4u * (i % (KC / 4u))) * 16u + r / 4u;
        for (var c = 0u; c < 4u; c++) {
            qs[base + c * 16u][r % 4u] = v[c];
        }
    }
    for (var i = lid; i < KEYS * KC / 4u; i += 256u) {   // (key, dim quad) of K
        let j = i / (KC / 4u);
        let key = min(key0 + j, P.n_ctx - 1u);
        var v = vec4<f32>(0.0);
        if (d4 < HD4) {
            v = KV[(kv_head * P.n_ctx + key) * HD4 + d4];
        }
        let base = (4u * (i % (KC / 4u))) * (KEYS / 4u) + j / 4u;
        for (var c = 0u; c < 4u; c++) {
            ks[base + c * (KEYS / 4u)][j % 4u] = v[c];
        }
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let tr = lid / 16u;
    let tc = lid % 16u;
    let block = wid.x;
    let kv_head = wid.y;
    // the positions of my 4 rows, and the keys the whole block sees
    var pos: array<u32, 4>;
    for (var e = 0u; e < 4u; e++) {
        pos[e] = S.n_past + min(row_of(block, 4u * tr + e).x, S.n_tokens - 1u);
    }
    let first_pos = S.n_past + row_of(block, 0u).x;
    let last_pos = S.n_past + min(row_of(block, ROWS - 1u).x, S.n_tokens - 1u);
    var lo = 0u;
    if (P.window > 0u && first_pos + 1u > P.window) {
        lo = first_pos + 1u - P.window;
    }
    lo = lo / KEYS * KEYS;

    var m = vec4<f32>(EMPTY);     // running max of my rows
    var l = vec4<f32>(0.0);       // running sum of my rows over my columns
    var o: array<mat4x4<f32>, DB>;  // O of my rows: column = row, vec4 over 4 dims
    for (var key0 = lo; key0 <= last_pos; key0 += KEYS) {
        var s: array<vec4<f32>, SC>;  // s[c][e]: key key0 + SC tc + c, row 4 tr + e
        for (var c = 0u; c < SC; c++) {
            s[c] = vec4<f32>(0.0);  // explicitly: Naga zeroes a loop's `var` once, not on every iteration
        }
        for (var d0 = 0u; d0 < HD; d0 += KC) {
            workgroupBarrier();
            load_chunk(lid, block, kv_head, key0, d0);
            workgroupBarrier();
            for (var k = 0u; k < KC; k++) {
                let q = qs[k * 16u + tr];
                let quad = ks[k * (KEYS / 4u) + (SC * tc) / 4u];  // my SC keys: all 4, or half
                let kk = select(quad, quad.zwzw, SC == 2u && tc % 2u == 1u);
                for (var c = 0u; c < SC; c++) {
                    s[c] += q * kk[c];
                }
            }
        }
        // mask, soft-cap, and the tile's max of each row over my columns
        var tile_max = vec4<f32>(EMPTY);
        for (var c = 0u; c < SC; c++) {
            let key = key0 + SC * tc + c;
            for (var e = 0u; e < 4u; e++) {
                var v = s[c][e];
                if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
                    v = P.softcap * tanh(clamp(v / P.softcap, -20.0, 20.0));
                }
                s[c][e] = select(EMPTY, v, visible(pos[e], key));
            }
            tile_max = max(tile_max, s[c]);
        }
        for (var e = 0u; e < 4u; e++) {
            row_max[(4u * tr + e) * 16u + tc] = tile_max[e];
        }
        workgroupBarrier();
        var new_m = m;
        for (var j = 0u; j < 16u; j++) {
            for (var e = 0u; e < 4u; e++) {
                new_m[e] = max(new_m[e], row_max[(4u * tr + e) * 16u + j]);
            }
        }
        let correction = exp(m - new_m);
        m = new_m;
        l *= correction;
        for (var c = 0u; c < SC; c++) {
            let p = select(vec4<f32>(0.0), exp(s[c] - m), s[c] > vec4<f32>(EMPTY));
            l += p;
            ps[(SC * tc + c) * 16u + tr] = p;
        }
        for (var j = 0u; j < DB; j++) {
            o[j] = mat4x4<f32>(o[j][0] * correction[0], o[j][1] * correction[1], o[j][2] * correction[2],
                               o[j][3] * correction[3]);
        }
        // O += P V, 64 head dims at a time
        for (var j = 0u; j < DB; j++) {
            workgroupBarrier();
            for (var i = lid; i < KEYS * 16u; i += 256u) {   // (key, dim quad) of V
                let key = min(key0 + i / 16u, P.n_ctx - 1u);
                let dq = 16u * j + i % 16u;
                var v = vec4<f32>(0.0);
                if (dq < HD4) {
                    v = KV[(P.n_head_kv + kv_head) * P.n_ctx * HD4 + key * HD4 + dq];
                }
                vs[i] = v;
            }
            workgroupBarrier();
            var acc = o[j];
            for (var k = 0u; k < KEYS; k++) {
                let p = ps[k * 16u + tr];
                let v = vs[k * 16u + tc];
                acc = mat4x4<f32>(acc[0] + v * p.x, acc[1] + v * p.y, acc[2] + v * p.z, acc[3] + v * p.w);
            }
            o[j] = acc;
        }
    }
    // each row's sum over all columns: my l covers my columns only
    workgroupBarrier();
    for (var e = 0u; e < 4u; e++) {
        row_max[(4u * tr + e) * 16u + tc] = l[e];
    }
    workgroupBarrier();
    var total = vec4<f32>(0.0);
    for (var j = 0u; j < 16u; j++) {
        for (var e = 0u; e < 4u; e++) {
            total[e] += row_max[(4u * tr + e) * 16u + j];
        }
    }
    for (var e = 0u; e < 4u; e++) {
        let row = row_of(block, 4u * tr + e);
        if (row.x < S.n_tokens) {
            let out = (row.x * P.n_head + kv_head * GROUP + row.y) * HD;
            for (var j = 0u; j < DB; j++) {
                for (var c = 0u; c < 4u; c++) {
                    let d = 64u * j + 4u * tc + c;
                    if (d < HD) {
                        OUT[out + d] = o[j][e][c] / total[e];
                    }
                }
            }
        }
    }
}
