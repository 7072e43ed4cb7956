#!/bin/bash
# One device call, airframe and llama.cpp's Vulkan backend on the same synthetic Llama 3.2 1B files:
# llama.cpp (the kit's source) builds in the background while the files are written, then
# llama-bench (pp512, tg128, depth 0 and 4096, 3 repetitions) and airframe bench (128 decode steps
# a row, as many tokens as tg128) run one after the other.
# WHILE_BUILDING, if set, is a command run once the files are written, while llama.cpp still builds.
#   WHILE_BUILDING="python3 dev/webgpu/check_candidates.py /tmp/l1b_Q4_K_M.gguf" \
#     bash dev/webgpu/side_by_side.sh "BF16 Q8_0 Q4_K_M"
set -u
types=${1:-"BF16 Q8_0 Q4_K_M"}
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
wait "${makes[@]}"
if [ -n "${WHILE_BUILDING:-}" ]; then
  bash -c "$WHILE_BUILDING" 2>&1 | grep -v XDG | tee $OUT/while_building.txt
fi
wait $build
tail -1 /tmp/lc/vk.log
for q in $types; do
  echo "=== llama.cpp Vulkan $q"
  /tmp/lc/src/bvk/bin/llama-bench -m /tmp/l1b_$q.gguf -ngl 99 -fa 1 -p 512 -n 128 -d 0,4096 -r 3 -o md 2>&1 \
    | grep -E "^\||ggml_vulkan: 0" | tee -a $OUT/llamacpp.txt
done
for q in $types; do
  python3 - "$q" <<'PY' 2>&1 | grep -v "XDG\|it/s\|tok/s\|part/s\|step/s\|s/step" | tee -a $OUT/bench.txt
import json, os, sys
from airframe.gpu.bench import bench_webgpu, format_result
q = sys.argv[1]
r = bench_webgpu(f"/tmp/l1b_{q}.gguf", [1, 512, 4096], steps=128)  # as many tokens as tg128
print(format_result(r))
json.dump(r, open(os.path.join(os.environ["OUT"], f"bench_{q}.json"), "w"), indent=1)
PY
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
