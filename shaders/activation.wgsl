// The mode bits of the matmul programs (P.mode of gemm.wgsl and gemm_rows.wgsl, gemv.wgsl's MODE),
// the gated-FFN activations and the output write they share; write_y uses the includer's Y.
// GELU with the tanh approximation: https://arxiv.org/abs/1606.08415 eq. (2), as gguf/llama.cpp use it.

const MODE_NORM: u32 = 1u;      // multiply the input by rmsnorm(x) * norm weight first
const MODE_ACCUMULATE: u32 = 2u; // Y += result (residual add) instead of Y = result
const MODE_GATED: u32 = 4u;     // two weights (gate at w0, up at w1): Y = act(gate.x) * (up.x)
const MODE_GELU: u32 = 8u;      // the gated activation is GELU-tanh (otherwise SiLU)
const MODE_X_STEP: u32 = 16u;   // the first input token is S.lm_first (LM head of the last position)
const MODE_ROUND_OUT: u32 = 32u; // gemv.wgsl: Y also gets the output rounded to 8 bits, for the next matmul

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

fn gelu_tanh(x: f32) -> f32 {
    let c = 0.7978845608028654;  // sqrt(2 / pi)
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

fn gated(mode: u32, gate: f32, up: f32) -> f32 {
    if ((mode & MODE_GELU) != 0u) {
        return gelu_tanh(gate) * up;
    }
    return silu(gate) * up;
}

// Output `at` from its sums: a (the gate's with MODE_GATED) and b (the up's), each times `scale`
// (1 / rms with MODE_NORM, else 1), then the gated activation; added to Y with MODE_ACCUMULATE.
// Returns the output before the add.
fn write_y(mode: u32, at: u32, a: f32, b: f32, scale: f32) -> f32 {
    var y = a * scale;
    if ((mode & MODE_GATED) != 0u) {
        y = gated(mode, y, b * scale);
    }
    if ((mode & MODE_ACCUMULATE) != 0u) {
        Y[at] = Y[at] + y;
    } else {
        Y[at] = y;
    }
    return y;
}
