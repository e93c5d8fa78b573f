#!/usr/bin/env bash
# Run here, after scripts/setup.sh, before scripts/gpu_check.sh runs on a GPU machine with no
# network: puts into .gpu/ (git-ignored; carry it to that machine) the packages minivllm needs
# that its Python 3.12 image lacks, as wheels of the versions this venv runs, and SmolLM2's
# tokenizer exported from the GGUF (the tiny test models and the benchmark model use it; the
# GGUF itself is too large to carry).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/wheels
pins=$(.venv/bin/pip freeze | grep -i -E '^(msgspec|pyzmq|gguf|fastapi|starlette|uvicorn|pydantic|pydantic[_-]core|annotated[_-]types|typing[_-]inspection)==')
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels $pins
HF_HUB_OFFLINE=1 .venv/bin/python -c "
import sys; sys.path.insert(0, 'tests/support')
import reference; reference.export_smollm2_tokenizer('.gpu/tokenizer')"
du -sh .gpu
