"""Imported first by the tests that run Triton kernels: without CUDA they run under the Triton
interpreter on the CPU, which must be chosen before any kernel is defined (triton.jit reads
TRITON_INTERPRET when it wraps a function). Nothing else in minivllm runs Triton on the CPU."""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
