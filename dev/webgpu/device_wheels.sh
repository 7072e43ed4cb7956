#!/bin/bash
# Adds to the device kit (.device/wheels, installed by .device/enter.sh) the wheels that the server,
# structured output and their tests need and the GPU image lacks: llguidance, FastAPI, the openai
# client, jsonschema and what they depend on, for the GPU machine's Python 3.12 on x86-64 Linux.
#   bash dev/webgpu/device_wheels.sh   (on this machine, after ../shared/device/install-kit.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels=.device/wheels
[ -d "$wheels" ] || { echo "no $wheels: run the kit's install-kit.sh first" >&2; exit 1; }
pick=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any -d "$wheels")
pip download -q --no-deps "${pick[@]}" "llguidance==1.9.1"
pip download -q "${pick[@]}" fastapi openai httpx jinja2 tqdm jsonschema
du -sh "$wheels"
