// `half`, the type of a program's tiles and per-step products: f32 (CPU adapters, no shader-f16)
alias half = f32;
