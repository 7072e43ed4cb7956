// gemv.wgsl's unit for Q5_0: a block of 32 weights d (q - 16), through gemv/block32.wgsl.

#include "gemv/words.wgsl"
#include "gemv/x_int8.wgsl"

const BLOCK_WORDS: u32 = 6u;
const QH_WORDS: u32 = 1u;
const OFFSET: i32 = 16;
const HAS_MIN: u32 = 0u;

#include "gemv/block32.wgsl"
