// gemv.wgsl's unit for Q4_1: a block of 32 weights d q + m, through gemv/block32.wgsl.

#include "gemv/words.wgsl"
#include "gemv/x_int8.wgsl"

const BLOCK_WORDS: u32 = 5u;
const QH_WORDS: u32 = 0u;
const OFFSET: i32 = 0;
const HAS_MIN: u32 = 1u;

#include "gemv/block32.wgsl"
