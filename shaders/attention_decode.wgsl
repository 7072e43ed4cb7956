// Grouped-query attention of one decode token over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html). Workgroup (split,
// kv head) serves every query head of the K/V group, so each K and V row is read once for the group,
// over positions [split * split_len, (split + 1) * split_len) that the query sees (pos - j <
// window on sliding-window layers), in blocks of BLOCK positions with an online softmax. Workgroup
// id z is the token's row of a decode batch (decode_rows.wgsl): its projections, its output, its
// slot's cache and position; the grid's splits are the longest row's, the others' extra workgroups
// return at once.
// It first does rope.wgsl's work for what it needs: bias, QK-norm and RoPE of its query heads and
// of the new key; the split holding the new position writes K and V to the cache and uses them from
// workgroup memory itself, so no workgroup waits for its own write. Every load that does not depend
// on another (raw heads, biases, angles) is issued before the first barrier.
// Scores: an invocation per position (a K row as HD / 4 vec4); the block's maxima and sums go across
// subgroups (lanes_{REDUCE}.wgsl), then once through workgroup memory. P V: invocation (slice, dim
// quad) takes every SLICES-th position, then the slices are added. With one split the workgroup
// writes the normalized output itself. With more, each writes its partial output, running max and
// sum to PART and counts itself in ARRIVED; the last of a K/V head's splits to arrive combines
// them: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M the largest m_s (no merge dispatch).
// Per-head values live in vec4 lanes (heads 0-3 in .lo, 4-7 in .hi, Heads) and the outputs in
// named variables: no private array is indexed, which the H200's compiler put in local memory
// (1.9 times slower). A group has at most 8 query heads.

#include "rope_params.wgsl"

#include "attention_params.wgsl"

#include "decode_rows.wgsl"

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (n_q + 2 n_kv,) raw projections
@group(0) @binding(1) var<storage, read> W: array<u32>;              // the layer: QK-norm weights, biases
@group(0) @binding(2) var<storage, read> T: array<f32>;              // RoPE angle table
@group(0) @binding(3) var<storage, read_write> KV: array<vec4<f32>>; // per slot, K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(4) var<storage, read_write> PART: array<vec4<f32>>; // per row and K/V head (head_part)
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;      // (rows, n_head * head_dim)
@group(0) @binding(6) var<uniform> P: Params;
@group(0) @binding(7) var<uniform> R: RopeParams;
@group(0) @binding(8) var<storage, read> ROWS: array<DecodeRow>;
@group(0) @binding(9) var<storage, read_write> ARRIVED: array<atomic<u32>>;  // (rows, n_head_kv), 0 between dispatches

var<private> kv0: u32;    // the row's cache: its first vec4 in KV
var<private> qkv0: u32;   // the row's projections: its first float in QKV
var<private> lanes: u32;  // lanes of a subgroup, found once

const WG: u32 = 128u;
const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim, a multiple of 4, at most 256
const BLOCK: u32 = {ATTN_BLOCK}u;     // positions whose scores are held at once: WG or a multiple
const HD4: u32 = HD / 4u;
const SLICES: u32 = WG / HD4;         // P V: invocations per dim quad
const FRESH: u32 = GROUP + 1u;        // heads made ready here: the group's queries, then the key
const PAIRS: u32 = (FRESH * HD / 2u + WG - 1u) / WG;  // rotated pairs per invocation, at most
const HEADS_PASS: u32 = 4u;           // heads whose P V slices are added at once: one vec4 of Heads
const EMPTY: f32 = -1.0e30;           // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs
const MAX_SUBGROUPS: u32 = 32u;       // WG / the narrowest subgroup (4 lanes)
const MAX_SPLITS: u32 = 256u;         // splits of a decode token at most (backend.MAX_SPLITS)
const STRIDE: u32 = HD4 + 1u;         // a split's partial in vec4: its output, then (m, l, 0, 0)
const OUTS: u32 = GROUP * HD4;        // the merge's outputs: a dim quad of a query head
const MERGE_SLICES: u32 = max(1u, WG / OUTS);  // the merge's invocations per output

#include "lanes_{REDUCE}.wgsl"

var<workgroup> fresh: array<f32, FRESH * HD>;              // (FRESH, HD): heads at the new position
var<workgroup> queries: array<vec4<f32>, 8u * HD4>;        // (head, dim quad): the rotated queries, pre-scaled; 0 past GROUP
var<workgroup> fresh_v: array<vec4<f32>, HD4>;             // the new value (split holding pos)
var<workgroup> row_scale: array<f32, FRESH>;               // 1 / rms of each fresh head (QK-norm)
var<workgroup> probs: array<Heads, BLOCK>;                 // scores, then probabilities, of the block's positions
var<workgroup> xchg: array<Heads, MAX_SUBGROUPS>;          // each subgroup's maxima or sums
// (slice, head of the pass, dim quad); in the merge, each split's weights (2 vec4)
var<workgroup> part_o: array<vec4<f32>, max(SLICES * HEADS_PASS * HD4, 2u * MAX_SPLITS)>;
var<workgroup> arrivals: u32;                              // splits of the K/V head done before this one

// the values of a group's 8 query heads at most: heads 0-3 in lo, 4-7 in hi
struct Heads {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn heads(v: f32) -> Heads {
    return Heads(vec4<f32>(v), vec4<f32>(v));
}

// per head, the maximum (is_max) or the sum of v over the workgroup
fn heads_total(v: Heads, lid: u32, is_max: bool) -> Heads {
    var out = v;  // heads 4-7 only where the group has them
    if (is_max) {
        out.lo = lanes_max4(v.lo, lid);
        if (GROUP > 4u) {
            out.hi = lanes_max4(v.hi, lid);
        }
    } else {
        out.lo = lanes_sum4(v.lo, lid);
        if (GROUP > 4u) {
            out.hi = lanes_sum4(v.hi, lid);
        }
    }
    workgroupBarrier();  // the previous exchange has been read
    if (lid % lanes == 0u) {
        xchg[lid / lanes] = out;
    }
    workgroupBarrier();
    var total = heads(select(0.0, EMPTY, is_max));
    for (var s = 0u; s < WG / lanes; s++) {
        let x = xchg[s];
        if (is_max) {
            total = Heads(max(total.lo, x.lo), max(total.hi, x.hi));
        } else {
            total = Heads(total.lo + x.lo, total.hi + x.hi);
        }
    }
    return total;
}

// The group's query heads and the K/V head's key at position pos, with bias, QK-norm and RoPE
// applied as rope.wgsl does, into `fresh`; the split holding pos writes K and V to the cache.
fn rope_fresh(lid: u32, kv_head: u32, pos: u32, holds_pos: bool) {
    let n_q = R.n_head * HD;
    let q_src = kv_head * GROUP * HD;
    let k_src = n_q + kv_head * HD;
    let v_src = qkv0 + k_src + R.n_head_kv * HD;
    let half = R.rope_dim / 2u;
    var angles: array<vec2<f32>, PAIRS>;   // cos, sin of my pairs, loaded with the heads
    for (var i = 0u; i < PAIRS; i++) {
        let e = lid + i * WG;
        if (e < FRESH * half) {
            let at = R.table + (pos * half + e % half) * 2u;
            angles[i] = vec2<f32>(T[at], T[at + 1u]);
        }
    }
    for (var e = lid; e < FRESH * HD; e += WG) {
        let is_k = e >= GROUP * HD;
        let d = e % HD;
        var v = QKV[qkv0 + select(q_src + e, k_src + d, is_k)];
        if (R.qkv_bias == 1u) {
            v += bitcast<f32>(W[select(R.q_bias + q_src + e, R.k_bias + kv_head * HD + d, is_k)]);
        }
        fresh[e] = v;
    }
    if (holds_pos && lid < HD4) {
        var v = vec4<f32>(QKV[v_src + 4u * lid], QKV[v_src + 4u * lid + 1u], QKV[v_src + 4u * lid + 2u],
                          QKV[v_src + 4u * lid + 3u]);
        if (R.qkv_bias == 1u) {
            let b = R.v_bias + kv_head * HD + 4u * lid;
            v += vec4<f32>(bitcast<f32>(W[b]), bitcast<f32>(W[b + 1u]), bitcast<f32>(W[b + 2u]), bitcast<f32>(W[b + 3u]));
        }
        fresh_v[lid] = v;
        KV[kv0 + R.n_head_kv * R.n_ctx * HD4 + (kv_head * R.n_ctx + pos) * HD4 + lid] = v;
    }
    workgroupBarrier();
    if (R.qk_norm == 1u) {
        for (var r = lid; r < FRESH; r += WG) {
            var sum = 0.0;
            for (var d = 0u; d < HD; d++) {
                sum += fresh[r * HD + d] * fresh[r * HD + d];
            }
            row_scale[r] = inverseSqrt(sum / f32(HD) + R.eps);
        }
        workgroupBarrier();
        for (var e = lid; e < FRESH * HD; e += WG) {
            let r = e / HD;
            let w = select(R.q_norm_w, R.k_norm_w, r == GROUP) + e % HD;
            fresh[e] = fresh[e] * row_scale[r] * bitcast<f32>(W[w]);
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < PAIRS; i++) {
        let e = lid + i * WG;
        if (e < FRESH * half) {
            let p = (e / half) * HD + rope_pair(e % half, R.neox, R.rope_dim);
            let a = fresh[p.x];
            let b = fresh[p.y];
            fresh[p.x] = a * angles[i].x - b * angles[i].y;  // every invocation writes only its own pairs
            fresh[p.y] = a * angles[i].y + b * angles[i].x;
        }
    }
    workgroupBarrier();
    if (holds_pos && lid < HD4) {
        let k = GROUP * HD + 4u * lid;
        KV[kv0 + (kv_head * R.n_ctx + pos) * HD4 + lid] = vec4<f32>(fresh[k], fresh[k + 1u], fresh[k + 2u], fresh[k + 3u]);
    }
    for (var i = lid; i < GROUP * HD4; i += WG) {
        queries[i] = vec4<f32>(fresh[4u * i], fresh[4u * i + 1u], fresh[4u * i + 2u], fresh[4u * i + 3u]) * P.scale;
    }
    workgroupBarrier();
}

fn key(kv_head: u32, j: u32, pos: u32, i: u32) -> vec4<f32> {
    if (j == pos) {  // the new key: this workgroup made it
        let at = GROUP * HD + 4u * i;
        return vec4<f32>(fresh[at], fresh[at + 1u], fresh[at + 2u], fresh[at + 3u]);
    }
    return KV[kv0 + (kv_head * P.n_ctx + j) * HD4 + i];
}

fn value(kv_head: u32, j: u32, pos: u32, dq: u32) -> vec4<f32> {
    if (j == pos) {
        return fresh_v[dq];
    }
    return KV[kv0 + (P.n_head_kv + kv_head) * P.n_ctx * HD4 + j * HD4 + dq];
}

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let split = wid.x;
    let kv_head = wid.y;
    let row = ROWS[wid.z];
    let n_splits = row_splits(row);
    if (split >= n_splits) {
        return;  // a shorter row of the batch: the whole workgroup leaves before any barrier
    }
    kv0 = row.kv;
    lanes = lane_count();
    qkv0 = wid.z * P.qkv_stride;
    let pos = row.n_past;
    let split_len = row.split_len;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let begin = max(lo, split * split_len);
    let end = min(pos + 1u, (split + 1u) * split_len);
    rope_fresh(lid, kv_head, pos, split * split_len <= pos && pos < (split + 1u) * split_len);

    let dq = lid % HD4;          // P V: my dim quad and slice of positions
    let slice = lid / HD4;
    var m = heads(EMPTY);
    var l = heads(0.0);
    var o0 = vec4<f32>(0.0);     // the output of head g at my dim quad: og
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    var o4 = vec4<f32>(0.0);
    var o5 = vec4<f32>(0.0);
    var o6 = vec4<f32>(0.0);
    var o7 = vec4<f32>(0.0);
    for (var b = begin; b < end; b += BLOCK) {
        let n = min(BLOCK, end - b);
        var top = heads(EMPTY);
        for (var j = lid; j < n; j += WG) {
            var s = heads(0.0);
            for (var i = 0u; i < HD4; i++) {
                let k = key(kv_head, b + j, pos, i);
                s.lo += vec4<f32>(dot(queries[i], k), dot(queries[HD4 + i], k), dot(queries[2u * HD4 + i], k),
                                  dot(queries[3u * HD4 + i], k));
                if (GROUP > 4u) {
                    s.hi += vec4<f32>(dot(queries[4u * HD4 + i], k), dot(queries[5u * HD4 + i], k),
                                      dot(queries[6u * HD4 + i], k), dot(queries[7u * HD4 + i], k));
                }
            }
            if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
                s = Heads(P.softcap * tanh(clamp(s.lo / P.softcap, vec4<f32>(-20.0), vec4<f32>(20.0))),
                          P.softcap * tanh(clamp(s.hi / P.softcap, vec4<f32>(-20.0), vec4<f32>(20.0))));
            }
            probs[j] = s;
            top = Heads(max(top.lo, s.lo), max(top.hi, s.hi));
        }
        let block_max = heads_total(top, lid, true);
        let new_m = Heads(max(m.lo, block_max.lo), max(m.hi, block_max.hi));
        var c = heads(1.0);  // the old sums' correction
        c.lo = exp(m.lo - new_m.lo);
        if (GROUP > 4u) {
            c.hi = exp(m.hi - new_m.hi);
        }
        m = new_m;
        var sums = heads(0.0);
        for (var j = lid; j < n; j += WG) {
            var p = heads(0.0);
            p.lo = exp(probs[j].lo - m.lo);
            if (GROUP > 4u) {
                p.hi = exp(probs[j].hi - m.hi);
            }
            probs[j] = p;
            sums = Heads(sums.lo + p.lo, sums.hi + p.hi);
        }
        let block_sum = heads_total(sums, lid, false);  // its barriers also publish `probs`
        l = Heads(l.lo * c.lo + block_sum.lo, l.hi * c.hi + block_sum.hi);
        o0 *= c.lo.x;
        o1 *= c.lo.y;
        o2 *= c.lo.z;
        o3 *= c.lo.w;
        o4 *= c.hi.x;
        o5 *= c.hi.y;
        o6 *= c.hi.z;
        o7 *= c.hi.w;
        if (slice < SLICES) {
            for (var j = slice; j < n; j += SLICES) {
                let v = value(kv_head, b + j, pos, dq);
                let p = probs[j];
                o0 += p.lo.x * v;
                o1 += p.lo.y * v;
                o2 += p.lo.z * v;
                o3 += p.lo.w * v;
                if (GROUP > 4u) {
                    o4 += p.hi.x * v;
                    o5 += p.hi.y * v;
                    o6 += p.hi.z * v;
                    o7 += p.hi.w * v;
                }
            }
        }
        workgroupBarrier();  // `probs` is overwritten by the next block
    }
    // add the slices, 4 heads at a time, and write
    let part = row.part;
    let out = wid.z * R.n_head * HD;
    write_heads(lid, dq, slice, 0u, o0, o1, o2, o3, m.lo, l.lo, kv_head, split, n_splits, part, out);
    if (GROUP > 4u) {
        write_heads(lid, dq, slice, 4u, o4, o5, o6, o7, m.hi, l.hi, kv_head, split, n_splits, part, out);
    }
    if (n_splits == 1u) {
        return;
    }
    // the barrier's device scope (naga: OpControlBarrier with Device memory scope) orders every
    // invocation's partials before the count, and the count before the last split's reads
    storageBarrier();
    let counter = wid.z * R.n_head_kv + kv_head;
    if (lid == 0u) {
        arrivals = atomicAdd(&ARRIVED[counter], 1u);
    }
    if (workgroupUniformLoad(&arrivals) + 1u < n_splits) {
        return;
    }
    storageBarrier();
    merge(lid, kv_head, n_splits, part, out);
    if (lid == 0u) {
        atomicStore(&ARRIVED[counter], 0u);  // ready for the next layer
    }
}

// first vec4 of query head h's partials in the row's PART: the K/V head's splits of all its query
// heads, each K/V head's in whole 128-byte lines (no line holds two heads' partials, so no cached
// line of one K/V head's can be stale for another's merge)
fn head_part(part: u32, h: u32, n_splits: u32) -> u32 {
    let heads_vec4 = (GROUP * n_splits * STRIDE + 7u) / 8u * 8u;
    return part / 4u + (h / GROUP) * heads_vec4 + (h % GROUP) * n_splits * STRIDE;
}

// the running max (x) and sum (y) of split s for the group's query heads: (m, l)
fn split_ml(first: u32, n_splits: u32, s: u32) -> array<Heads, 2> {
    var m = heads(EMPTY);
    var l = heads(0.0);
    if (s < n_splits) {
        for (var g = 0u; g < min(GROUP, 4u); g++) {
            let v = PART[first + g * n_splits * STRIDE + s * STRIDE + HD4];
            m.lo[g] = v.x;
            l.lo[g] = v.y;
        }
        for (var g = 4u; g < GROUP; g++) {
            let v = PART[first + g * n_splits * STRIDE + s * STRIDE + HD4];
            m.hi[g - 4u] = v.x;
            l.hi[g - 4u] = v.y;
        }
    }
    return array<Heads, 2>(m, l);
}

// the K/V head's query heads' outputs from every split's partial (the last split to finish); each
// invocation takes splits lid and lid + WG (MAX_SPLITS <= 2 WG)
fn merge(lid: u32, kv_head: u32, n_splits: u32, part: u32, row_out: u32) {
    let first = head_part(part, kv_head * GROUP, n_splits);
    let a = split_ml(first, n_splits, lid);
    let b = split_ml(first, n_splits, lid + WG);
    let top = Heads(max(a[0].lo, b[0].lo), max(a[0].hi, b[0].hi));
    let big = heads_total(top, lid, true);
    let wa = Heads(exp(a[0].lo - big.lo), exp(a[0].hi - big.hi));
    let wb = Heads(exp(b[0].lo - big.lo), exp(b[0].hi - big.hi));
    if (lid < n_splits) {
        part_o[2u * lid] = wa.lo;
        part_o[2u * lid + 1u] = wa.hi;
    }
    if (lid + WG < n_splits) {
        part_o[2u * (lid + WG)] = wb.lo;
        part_o[2u * (lid + WG) + 1u] = wb.hi;
    }
    let sums = Heads(a[1].lo * wa.lo + b[1].lo * wb.lo, a[1].hi * wa.hi + b[1].hi * wb.hi);
    let total = heads_total(sums, lid, false);  // its barriers also publish the weights
    // invocation (slice, head, dim quad) adds every MERGE_SLICES-th split, eight loaded at a time
    for (var i = lid; i < OUTS * MERGE_SLICES; i += WG) {
        let o = i % OUTS;
        let g = o / HD4;
        let at = first + g * n_splits * STRIDE + o % HD4;
        var acc = vec4<f32>(0.0);
        var s = i / OUTS;
        let step = MERGE_SLICES * STRIDE;
        for (; s + 7u * MERGE_SLICES < n_splits; s += 8u * MERGE_SLICES) {
            let p = at + s * STRIDE;
            let v0 = PART[p];
            let v1 = PART[p + step];
            let v2 = PART[p + 2u * step];
            let v3 = PART[p + 3u * step];
            let v4 = PART[p + 4u * step];
            let v5 = PART[p + 5u * step];
            let v6 = PART[p + 6u * step];
            let v7 = PART[p + 7u * step];
            acc += v0 * weight(s, g) + v1 * weight(s + MERGE_SLICES, g) + v2 * weight(s + 2u * MERGE_SLICES, g)
                 + v3 * weight(s + 3u * MERGE_SLICES, g) + v4 * weight(s + 4u * MERGE_SLICES, g)
                 + v5 * weight(s + 5u * MERGE_SLICES, g) + v6 * weight(s + 6u * MERGE_SLICES, g)
                 + v7 * weight(s + 7u * MERGE_SLICES, g);
        }
        for (; s < n_splits; s += MERGE_SLICES) {
            acc += PART[at + s * STRIDE] * weight(s, g);
        }
        if (MERGE_SLICES == 1u) {
            write_out(row_out, kv_head, o, acc, total);
        } else {
            probs[i].lo = acc;
        }
    }
    if (MERGE_SLICES > 1u) {
        workgroupBarrier();
        for (var o = lid; o < OUTS; o += WG) {
            var acc = vec4<f32>(0.0);
            for (var k = 0u; k < MERGE_SLICES; k++) {
                acc += probs[k * OUTS + o].lo;
            }
            write_out(row_out, kv_head, o, acc, total);
        }
    }
}

// split s's weight e^(m_s - M) for query head g of the group
fn weight(s: u32, g: u32) -> f32 {
    return select(part_o[2u * s + 1u][g % 4u], part_o[2u * s][g % 4u], g < 4u);
}

// output o (query head o / HD4 of the K/V head, dim quad o % HD4) over the heads' totals
fn write_out(row_out: u32, kv_head: u32, o: u32, acc: vec4<f32>, total: Heads) {
    let g = o / HD4;
    let l = select(total.hi[g % 4u], total.lo[g % 4u], g < 4u);
    out4(row_out + (kv_head * GROUP + g) * HD + 4u * (o % HD4), acc / l);
}

// floats at..at + 3 of OUT
fn out4(at: u32, v: vec4<f32>) {
    OUT[at] = v.x;
    OUT[at + 1u] = v.y;
    OUT[at + 2u] = v.z;
    OUT[at + 3u] = v.w;
}

// heads g0 .. g0 + 3 (those below GROUP): the slices added; the normalized output written with one
// split, else the partial output with its running max and sum
fn write_heads(lid: u32, dq: u32, slice: u32, g0: u32, a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>,
               m: vec4<f32>, l: vec4<f32>, kv_head: u32, split: u32, n_splits: u32, part: u32, row_out: u32) {
    workgroupBarrier();
    if (slice < SLICES) {
        let at = slice * HEADS_PASS * HD4 + dq;
        part_o[at] = a;
        part_o[at + HD4] = b;
        part_o[at + 2u * HD4] = c;
        part_o[at + 3u * HD4] = d;
    }
    workgroupBarrier();
    for (var i = lid; i < HEADS_PASS * HD4; i += WG) {
        let g = i / HD4;
        if (g0 + g < GROUP) {
            var o = vec4<f32>(0.0);
            for (var s = 0u; s < SLICES; s++) {
                o += part_o[s * HEADS_PASS * HD4 + i];
            }
            let h = kv_head * GROUP + g0 + g;
            if (n_splits == 1u) {
                out4(row_out + h * HD + 4u * (i % HD4), o / l[g]);
            } else {
                let out = head_part(part, h, n_splits) + split * STRIDE;
                PART[out + i % HD4] = o;
                if (i % HD4 == 0u) {
                    PART[out + HD4] = vec4<f32>(m[g], l[g], 0.0, 0.0);
                }
            }
        }
    }
}
