#!/usr/bin/env bash
# The test command: installs what is missing (see install.sh), then runs the whole suite on the
# CPU (WGSL shaders run on Mesa's lavapipe). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
AIRFRAME_WITH_HF=1 bash scripts/install.sh
exec .venv/bin/python -m pytest -q -ra "$@"
