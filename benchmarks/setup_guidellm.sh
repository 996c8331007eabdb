#!/usr/bin/env bash
# GuideLLM for benchmark 4 (tool_comparison.py), in its own venv: its pins (pydantic,
# transformers, ...) must not touch autotune's.  Idempotent.  Prints the variable the
# benchmark reads.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${GUIDELLM_VENV:-$ROOT/.venv-guidellm}
VERSION=${GUIDELLM_VERSION:-0.8.1}
if [ ! -x "$VENV/bin/guidellm" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "guidellm==$VERSION"
fi
echo "export AUTOTUNE_GUIDELLM=$VENV/bin/guidellm"
