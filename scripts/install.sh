#!/usr/bin/env bash
# Installs everything airframe needs on a Debian machine, idempotently:
# system packages (Vulkan loader + Mesa's lavapipe CPU driver, tmux for the terminal tests),
# a virtual environment in .venv with airframe and its test extras, and the real test models CI uses
# (not qwen2.5-coder-1.5b: tests/conftest.py --large-models).
# Set AIRFRAME_SKIP_MODELS=1 to skip fetching the models, AIRFRAME_WITH_HF=1 to add torch and
# transformers (for the tests that compare against HF transformers).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(python3 python3-venv python3-pip mesa-vulkan-drivers libvulkan1 tmux)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "installing system packages: ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# pip, minus the warnings some machines' pip configuration prints for index folders that do not exist
venv_pip() {
  .venv/bin/python -m pip "$@" --disable-pip-version-check \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
venv_pip install -q --upgrade pip >/dev/null
venv_pip install -q -e '.[test]'
if [ "${AIRFRAME_WITH_HF:-0}" = "1" ]; then
  venv_pip install -q -r scripts/requirements-hf.txt
fi

if [ "${AIRFRAME_SKIP_MODELS:-0}" != "1" ]; then
  .venv/bin/airframe pull smollm2-135m gemma3-270m qwen2.5-coder-0.5b
fi
