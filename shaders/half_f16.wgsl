// `half`, the type of a program's tiles and per-step products: f16 (tiled programs, shader-f16)
enable f16;
alias half = f16;
