#!/bin/bash
# One device call: the kernel tests on the GPU (its own tile sizes), the probe, then airframe bench
# on synthetic Llama 3.2 1B models.   bash dev/webgpu/h200_run.sh "BF16 Q8_0 Q4_K_M" "1,512,4096"
set -u
types=${1:-"BF16 Q8_0 Q4_K_M"}
ctxs=${2:-"1,512,4096"}
source .device/enter.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
for q in $types; do
  python3 scripts/make_synthetic_gguf.py --shape llama3.2-1b --fast --qtype $q -o /tmp/l1b_$q.gguf \
    --tokenizer .device/tokenizer-only-smollm2.gguf > /tmp/make_$q.log 2>&1 &
done
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider $TESTS 2>&1 | tail -5 | tee $OUT/tests.txt
fi
python3 dev/webgpu/probe.py ${PROBE_ARGS:-} --json $OUT/probe.json 2>&1 | grep -v XDG | tee $OUT/probe.txt
wait
for q in $types; do
  python3 - "$q" "$ctxs" <<'PY' 2>&1 | grep -v "XDG\|it/s\|tok/s\|part/s\|step/s\|s/step" | tee -a $OUT/bench.txt
import json, os, sys
from airframe.gpu.bench import bench_webgpu, format_result
q, ctxs = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
r = bench_webgpu(f"/tmp/l1b_{q}.gguf", ctxs, steps=32)
print(format_result(r))
json.dump(r, open(os.path.join(os.environ["OUT"], f"bench_{q}.json"), "w"), indent=1)
PY
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
