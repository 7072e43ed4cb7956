#!/bin/bash
# One device call: llama.cpp's Vulkan llama-bench builds in the background while the synthetic
# Llama 3.2 1B files are written and TESTS (if set) run on the GPU, then the probe (PROBE_ARGS, if
# set); then `airframe bench --concurrency`, llama-bench's batch-1 decode (tg128) and llama.cpp's
# decode of the same numbers of sequences at once (llamacpp_batched.cpp, built against the same
# build) on each file.
# BASE=DIR runs the probe first from another checkout too (e.g. `git archive` of main into
# .device/base), so that a kernel change is compared in the same lease.
#   TESTS="tests/test_gpu_batch.py" PROBE_ARGS="--parts gemv --tokens 1,8" \
#     bash dev/webgpu/concurrency.sh "Q4_K_M BF16" "1,2,4,8"
set -u
types=${1:-"Q4_K_M BF16"}
levels=${2:-"1,2,4,8"}
source .device/enter.sh
source dev/webgpu/llamacpp_vulkan.sh
build_llamacpp_vulkan &
build=$!
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
makes=()
for q in $types; do
  python3 scripts/make_synthetic_gguf.py --shape llama3.2-1b --fast --qtype $q -o /tmp/l1b_$q.gguf \
    --tokenizer .device/tokenizer-only-smollm2.gguf > /tmp/make_$q.log 2>&1 &
  makes+=($!)
done
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider $TESTS > $OUT/tests.txt 2>&1
  tail -3 $OUT/tests.txt
fi
if [ -n "${PROBE_ARGS:-}" ] && [ -n "${BASE:-}" ]; then
  ( cd "$BASE" && PYTHONPATH="/tmp/site:$PWD" python3 dev/webgpu/probe.py $PROBE_ARGS --json $OUT/probe_base.json \
      > $OUT/probe_base.txt 2>&1 )
  grep -E "^gemv|^stream" $OUT/probe_base.txt | sed 's/^/base: /' | tail -40
fi
if [ -n "${PROBE_ARGS:-}" ]; then
  python3 dev/webgpu/probe.py $PROBE_ARGS --json $OUT/probe.json > $OUT/probe.txt 2>&1
  grep -E "^gemv|^stream" $OUT/probe.txt | tail -40
fi
wait "${makes[@]}"
for q in $types; do
  python3 -u -m airframe bench /tmp/l1b_$q.gguf --concurrency $levels --steps 32 --json > $OUT/concurrency_$q.json \
    2> $OUT/concurrency_$q.err
  python3 -c "import json, sys; from airframe.gpu.bench import format_concurrency; \
print(format_concurrency(json.load(open(sys.argv[1]))))" $OUT/concurrency_$q.json | tee -a $OUT/concurrency.txt
done
wait $build
tail -1 /tmp/lc/vk.log
for q in $types; do
  echo "=== llama.cpp Vulkan $q" | tee -a $OUT/llamacpp.txt
  /tmp/lc/src/bvk/bin/llama-bench -m /tmp/l1b_$q.gguf -ngl 99 -fa 1 -p 0 -n 128 -d 0,128 -r 3 -o md 2>&1 \
    | grep -E "^\||ggml_vulkan: 0" | tee -a $OUT/llamacpp.txt
done
lc=/tmp/lc/src
g++ -O2 -std=c++17 dev/webgpu/llamacpp_batched.cpp -I$lc/include -I$lc/ggml/include -L$lc/bvk/bin -lllama -lggml \
  -lggml-base -Wl,-rpath,$lc/bvk/bin -o /tmp/lc/batched 2>&1 | tail -5
for q in $types; do
  echo "=== llama.cpp Vulkan $q, sequences at once" | tee -a $OUT/llamacpp.txt
  /tmp/lc/batched /tmp/l1b_$q.gguf $levels 128 64 2>/dev/null | tee -a $OUT/llamacpp.txt
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
