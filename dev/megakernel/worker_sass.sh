#!/usr/bin/env bash
# The shipped worker as build.py compiles it (nvcc -cubin -O3 -std=c++17 -Xptxas -v), for sm_90 and
# sm_86: OUT/worker-ARCH.cubin, its sha256, ptxas's report and cuobjdump's SASS. Run it before and
# after a change that must not change the program, then diff the two folders.
#
#     bash dev/megakernel/worker_sass.sh OUT
#
# Needs nvcc and cuobjdump (with nvdisasm) on PATH; no GPU.
set -euo pipefail
out=${1:?usage: worker_sass.sh OUT}
src="$(cd "$(dirname "$0")/../.." && pwd)/airframe/megakernel/cuda"
mkdir -p "$out"
for arch in sm_90 sm_86; do
    nvcc -cubin -arch=$arch -O3 -std=c++17 -Xptxas -v -I "$src" "$src/worker.cu" -o "$out/worker-$arch.cubin" \
        > "$out/ptxas-$arch.log" 2>&1
    grep -E "registers|spill" "$out/ptxas-$arch.log" > "$out/ptxas-summary-$arch.txt"
    cuobjdump -sass "$out/worker-$arch.cubin" > "$out/sass-$arch.txt"
done
(cd "$out" && sha256sum worker-*.cubin | tee sha256.txt)
