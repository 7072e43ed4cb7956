// Elements 4i..4i+3 of a Q5_0 or Q5_1 block as 5-bit integers: the nibbles of quant word w (word
// i % 4 of the block's quants, low nibbles for i < 4) with their fifth bits from qh.

fn q5_quads(qh: u32, w: u32, i: u32) -> vec4<f32> {
    let s = (i >> 2u) * 4u;
    let low = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    let e = 4u * i;
    let high = (vec4<u32>(qh) >> vec4<u32>(e, e + 1u, e + 2u, e + 3u)) & vec4<u32>(1u);
    return vec4<f32>(low | (high << vec4<u32>(4u)));
}
