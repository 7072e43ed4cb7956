// The outer-product step of the tiled programs, in `half` (the includer includes half_<type>.wgsl
// first): acc += w x^T, column c of acc gains w * x[c].

fn outer(acc: mat4x4<half>, w: vec4<half>, x: vec4<half>) -> mat4x4<half> {
    return mat4x4<half>(fma(w, vec4<half>(x.x), acc[0]), fma(w, vec4<half>(x.y), acc[1]),
                        fma(w, vec4<half>(x.z), acc[2]), fma(w, vec4<half>(x.w), acc[3]));
}
