#include "half_{HALF}.wgsl"

// Causal grouped-query attention of a prefill chunk over the K/V cache (which already holds the
// chunk's own keys, written by rope.wgsl): flash attention, https://arxiv.org/abs/2205.14135.
// Workgroup (row block, kv head): 64 query rows, row r = (token r / GROUP, query head r % GROUP of
// the K/V group), so every K and V tile serves all heads of the group. Per tile of KEYS positions:
// S = Q K^T by chunks of 16 head dims (Q and K chunks staged in workgroup memory, transposed so the
// inner loop reads vec4), an online softmax per row, then O += P V by blocks of 64 head dims.
// Each chunk and block is fetched into registers while the one before it is multiplied, and
// stored to workgroup memory after the next barrier.
// Invocation (tr, tc) owns rows 4 tr .. 4 tr + 3: their S at keys SC tc .. SC tc + SC - 1, their O
// at dims 64 j + 4 tc .. + 3. Scores and outputs live in named vec4 and mat4x4 variables, never in
// private arrays: the H200's compiler keeps arrays indexed in loops in local memory.
// Workgroup tiles are `half` (Pipelines.half: f16 on GPUs): each chunk's Q K^T and each tile's
// P V are summed in half, then added to f32 scores and outputs (1.6x faster than f32 on the H200
// at depth 4096; about 2e-3 of the largest output, tests/test_gpu_attention.py). The softmax
// stays f32.

#include "attention_params.wgsl"

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> QKV: array<vec4<f32>>;     // (tokens, (n_q + 2 n_kv) / 4), Q rotated
@group(0) @binding(1) var<storage, read> KV: array<vec4<f32>>;      // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;     // (tokens, n_head * head_dim)
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim, a multiple of 4, at most 256
const KEYS: u32 = {ATTN_KEYS}u;       // keys per tile: 32 or 64
const ROWS: u32 = 64u;                // query rows per workgroup
const KC: u32 = 16u;                  // head dims per S chunk: ROWS KC / 4 == 256, one Q vec4 per invocation
const DB: u32 = (HD + 63u) / 64u;     // blocks of 64 head dims: 1 to 4
const SC: u32 = KEYS / 16u;           // S columns per invocation: 2 or 4
const HD4: u32 = HD / 4u;
const EMPTY: f32 = -1.0e30;           // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs

var<workgroup> qs: array<vec4<half>, KC * 16u>;        // (dim, row quad): the Q chunk
var<workgroup> ks: array<vec4<half>, KC * KEYS / 4u>;  // (dim, key quad): the K chunk
var<workgroup> ps: array<vec4<half>, KEYS * 16u>;      // (key, row quad): probabilities
var<workgroup> vs: array<vec4<half>, KEYS * 16u>;      // (key, dim quad): a block of V
var<workgroup> xchg: array<vec4<f32>, 256u>;          // (tr, tc): each invocation's maxima or sums of its rows

// Query row r of this workgroup: (token, head), token == n_tokens when past the chunk
fn row_of(block: u32, r: u32) -> vec2<u32> {
    let index = block * ROWS + r;
    return vec2<u32>(min(index / GROUP, S.n_tokens), index % GROUP);
}

// What an invocation fetches of the Q and K chunks of head dims d0 .. d0 + KC: one vec4 of dims
// (4 dims of row lid / 4 and, for the first KEYS KC / 4 invocations, of key lid / 4)
struct Chunk {
    q: vec4<f32>,
    k: vec4<f32>,
}

fn fetch_chunk(lid: u32, block: u32, kv_head: u32, key0: u32, d0: u32) -> Chunk {
    let d4 = d0 / 4u + lid % (KC / 4u);
    var f: Chunk;
    let row = row_of(block, lid / (KC / 4u));
    let t = min(row.x, S.n_tokens - 1u);
    if (d4 < HD4) {
        f.q = QKV[t * P.qkv_stride / 4u + (kv_head * GROUP + row.y) * HD4 + d4] * P.scale;
    }
    let key = min(key0 + lid / (KC / 4u), P.n_ctx - 1u);
    if (lid < KEYS * KC / 4u && d4 < HD4) {
        f.k = KV[(kv_head * P.n_ctx + key) * HD4 + d4];
    }
    return f;
}

// a fetched chunk stored transposed, one float into each of 4 dims' runs
fn store_chunk(lid: u32, f: Chunk) {
    let r = lid / (KC / 4u);
    let base = (4u * (lid % (KC / 4u))) * 16u + r / 4u;
    for (var c = 0u; c < 4u; c++) {
        qs[base + c * 16u][r % 4u] = half(f.q[c]);
    }
    if (lid < KEYS * KC / 4u) {
        let j = lid / (KC / 4u);
        let kbase = (4u * (lid % (KC / 4u))) * (KEYS / 4u) + j / 4u;
        for (var c = 0u; c < 4u; c++) {
            ks[kbase + c * (KEYS / 4u)][j % 4u] = half(f.k[c]);
        }
    }
}

// Scores of my 4 rows (vec4 lanes) at one key: soft-capped, EMPTY where the key is not visible
fn masked(v: vec4<f32>, key: u32, pos: vec4<u32>) -> vec4<f32> {
    var x = v;
    if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
        x = P.softcap * tanh(clamp(x / P.softcap, vec4<f32>(-20.0), vec4<f32>(20.0)));
    }
    let k = vec4<u32>(key);
    let seen = (k <= pos) & (vec4<bool>(P.window == 0u) | (pos - k < vec4<u32>(P.window)));
    return select(vec4<f32>(EMPTY), x, seen);
}

// Per row of mine, the maximum (is_max) or the sum of v over the 16 invocations sharing my rows
fn across_row(v: vec4<f32>, tr: u32, tc: u32, is_max: bool) -> vec4<f32> {
    workgroupBarrier();  // the previous exchange has been read
    xchg[tr * 16u + tc] = v;
    workgroupBarrier();
    var total = xchg[tr * 16u];
    for (var j = 1u; j < 16u; j++) {
        let x = xchg[tr * 16u + j];
        total = select(total + x, max(total, x), is_max);
    }
    return total;
}

fn probs(s: vec4<f32>, m: vec4<f32>) -> vec4<f32> {
    return select(vec4<f32>(0.0), exp(s - m), s > vec4<f32>(EMPTY));
}

// o with each row's column scaled: rows are the columns of o
fn rescaled(o: mat4x4<f32>, c: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(o[0] * c.x, o[1] * c.y, o[2] * c.z, o[3] * c.w);
}

#include "outer_half.wgsl"

// h (column c: my key SC tc + c, lanes my rows) plus the products at dim k of the Q and K chunks
fn scores_step(h: mat4x4<half>, k: u32, tr: u32, tc: u32) -> mat4x4<half> {
    let q = qs[k * 16u + tr];
    let quad = ks[k * (KEYS / 4u) + (SC * tc) / 4u];  // my SC keys: all 4, or half
    if (SC == 4u) {
        return outer(h, q, quad);
    }
    let pair = select(quad.xy, quad.zw, tc % 2u == 1u);
    return mat4x4<half>(fma(q, vec4<half>(pair.x), h[0]), fma(q, vec4<half>(pair.y), h[1]), h[2], h[3]);
}

// h (column e: row 4 tr + e, lanes my 4 head dims) plus the products at key k of P and the V block
fn outputs_step(h: mat4x4<half>, k: u32, tr: u32, tc: u32) -> mat4x4<half> {
    return outer(h, vs[k * 16u + tc], ps[k * 16u + tr]);
}

// Entry i = (key, dim quad) of block j of V (head dims 64 j ..) at the tile's keys
fn v_at(i: u32, j: u32, key0: u32, kv_head: u32) -> vec4<f32> {
    let key = min(key0 + i / 16u, P.n_ctx - 1u);
    let dq = 16u * j + i % 16u;
    if (dq < HD4) {
        return KV[(P.n_head_kv + kv_head) * P.n_ctx * HD4 + key * HD4 + dq];
    }
    return vec4<f32>(0.0);
}

// What an invocation fetches of block j of V: entries lid + 256 e for e < KEYS / 16
fn fetch_v(lid: u32, j: u32, key0: u32, kv_head: u32) -> mat4x4<f32> {
    var f = mat4x4<f32>();
    f[0] = v_at(lid, j, key0, kv_head);
    f[1] = v_at(lid + 256u, j, key0, kv_head);
    if (KEYS == 64u) {
        f[2] = v_at(lid + 512u, j, key0, kv_head);
        f[3] = v_at(lid + 768u, j, key0, kv_head);
    }
    return f;
}

fn store_v(lid: u32, f: mat4x4<f32>) {
    vs[lid] = vec4<half>(f[0]);
    vs[lid + 256u] = vec4<half>(f[1]);
    if (KEYS == 64u) {
        vs[lid + 512u] = vec4<half>(f[2]);
        vs[lid + 768u] = vec4<half>(f[3]);
    }
}

fn write_rows(o: mat4x4<f32>, j: u32, block: u32, kv_head: u32, tr: u32, tc: u32, total: vec4<f32>) {
    for (var e = 0u; e < 4u; e++) {
        let row = row_of(block, 4u * tr + e);
        let d = 64u * j + 4u * tc;
        if (row.x < S.n_tokens && d < HD) {
            let out = (row.x * P.n_head + kv_head * GROUP + row.y) * HD + d;
            let v = o[e] / total[e];
            OUT[out] = v.x;
            OUT[out + 1u] = v.y;
            OUT[out + 2u] = v.z;
            OUT[out + 3u] = v.w;
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
    let last = S.n_tokens - 1u;
    let pos = S.n_past + vec4<u32>(min(row_of(block, 4u * tr).x, last), min(row_of(block, 4u * tr + 1u).x, last),
                                   min(row_of(block, 4u * tr + 2u).x, last), min(row_of(block, 4u * tr + 3u).x, last));
    let first_pos = S.n_past + row_of(block, 0u).x;
    let last_pos = S.n_past + min(row_of(block, ROWS - 1u).x, last);
    var lo = 0u;
    if (P.window > 0u && first_pos + 1u > P.window) {
        lo = first_pos + 1u - P.window;
    }
    lo = lo / KEYS * KEYS;

    var m = vec4<f32>(EMPTY);  // running max of my rows
    var l = vec4<f32>(0.0);    // running sum of my rows over my columns
    var o0 = mat4x4<f32>();    // O of my rows, head dims 64 j + 4 tc ..: column = row
    var o1 = mat4x4<f32>();
    var o2 = mat4x4<f32>();
    var o3 = mat4x4<f32>();
    var fc = fetch_chunk(lid, block, kv_head, lo, 0u);
    var fv = mat4x4<f32>();
    for (var key0 = lo; key0 <= last_pos; key0 += KEYS) {
        // s_c[e]: key key0 + SC tc + c, row 4 tr + e
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        for (var d0 = 0u; d0 < HD; d0 += KC) {
            workgroupBarrier();
            store_chunk(lid, fc);
            workgroupBarrier();
            if (d0 + KC < HD) {  // in flight while this chunk is multiplied
                fc = fetch_chunk(lid, block, kv_head, key0, d0 + KC);
            } else {
                fv = fetch_v(lid, 0u, key0, kv_head);
            }
            var h = mat4x4<half>();  // column c: key SC tc + c
            for (var k = 0u; k < KC; k += 8u) {  // unrolled by hand: Naga's loop guard keeps loops rolled
                h = scores_step(h, k, tr, tc);
                h = scores_step(h, k + 1u, tr, tc);
                h = scores_step(h, k + 2u, tr, tc);
                h = scores_step(h, k + 3u, tr, tc);
                h = scores_step(h, k + 4u, tr, tc);
                h = scores_step(h, k + 5u, tr, tc);
                h = scores_step(h, k + 6u, tr, tc);
                h = scores_step(h, k + 7u, tr, tc);
            }
            s0 += vec4<f32>(h[0]);
            s1 += vec4<f32>(h[1]);
            s2 += vec4<f32>(h[2]);
            s3 += vec4<f32>(h[3]);
        }
        let key = key0 + SC * tc;  // my first key; local index SC tc in the tile
        s0 = masked(s0, key, pos);
        s1 = masked(s1, key + 1u, pos);
        var tile_max = max(s0, s1);
        if (SC == 4u) {
            s2 = masked(s2, key + 2u, pos);
            s3 = masked(s3, key + 3u, pos);
            tile_max = max(tile_max, max(s2, s3));
        }
        let new_m = max(m, across_row(tile_max, tr, tc, true));
        let correction = exp(m - new_m);
        m = new_m;
        let p0 = probs(s0, m);
        let p1 = probs(s1, m);
        ps[SC * tc * 16u + tr] = vec4<half>(p0);
        ps[(SC * tc + 1u) * 16u + tr] = vec4<half>(p1);
        l = l * correction + p0 + p1;
        if (SC == 4u) {
            let p2 = probs(s2, m);
            let p3 = probs(s3, m);
            ps[(SC * tc + 2u) * 16u + tr] = vec4<half>(p2);
            ps[(SC * tc + 3u) * 16u + tr] = vec4<half>(p3);
            l += p2 + p3;
        }
        // O += P V, 64 head dims at a time, in main: the H200's compiler ran this loop 2.5 times
        // slower in a function taking and returning the block
        for (var j = 0u; j < DB; j++) {
            var acc = o0;
            if (j == 1u) {
                acc = o1;
            } else if (j == 2u) {
                acc = o2;
            } else if (j == 3u) {
                acc = o3;
            }
            acc = rescaled(acc, correction);
            workgroupBarrier();  // the probabilities are visible, the previous block of V read
            store_v(lid, fv);
            workgroupBarrier();
            if (j + 1u < DB) {
                fv = fetch_v(lid, j + 1u, key0, kv_head);
            } else if (key0 + KEYS <= last_pos) {
                fc = fetch_chunk(lid, block, kv_head, key0 + KEYS, 0u);
            }
            var h = mat4x4<half>();
            for (var k = 0u; k < KEYS; k += 8u) {
                h = outputs_step(h, k, tr, tc);
                h = outputs_step(h, k + 1u, tr, tc);
                h = outputs_step(h, k + 2u, tr, tc);
                h = outputs_step(h, k + 3u, tr, tc);
                h = outputs_step(h, k + 4u, tr, tc);
                h = outputs_step(h, k + 5u, tr, tc);
                h = outputs_step(h, k + 6u, tr, tc);
                h = outputs_step(h, k + 7u, tr, tc);
            }
            acc += mat4x4<f32>(h);
            if (j == 0u) {
                o0 = acc;
            } else if (j == 1u) {
                o1 = acc;
            } else if (j == 2u) {
                o2 = acc;
            } else {
                o3 = acc;
            }
        }
    }
    // each row's sum over all columns: my l covers my columns only
    let total = across_row(l, tr, tc, false);
    write_rows(o0, 0u, block, kv_head, tr, tc, total);
    if (DB > 1u) {
        write_rows(o1, 1u, block, kv_head, tr, tc, total);
    }
    if (DB > 2u) {
        write_rows(o2, 2u, block, kv_head, tr, tc, total);
    }
    if (DB > 3u) {
        write_rows(o3, 3u, block, kv_head, tr, tc, total);
    }
}
