"""Shared fixtures: the SmolLM2 tokenizer / HF export and tiny random-weight checkpoints.

Session fixtures (each built at most once per pytest session, only when requested):

* ``tokenizer_dir``        -- SmolLM2 tokenizer files only (tokenizer.json, tokenizer_config.json,
                              chat_template.jinja), read from the GGUF (~5 s).
* ``smollm2_hf_dir``       -- plain HF export of SmolLM2-135M-Instruct (fp32 safetensors, tied
                              embeddings, tokenizer copied from ``tokenizer_dir``) (~25 s).
* ``smollm2_gguf_logits``  -- ``(prompt_ids, logits[1, L, V])`` of the GGUF-loaded transformers
                              model, computed during the export (the GGUF model is then freed).
* ``make_tiny_model``      -- factory ``make_tiny_model(arch, **kw) -> Path`` (cached per args).

``tiny_model_dir`` is function-scoped and parametrizable with ``indirect=True``: the param is an
arch name (``"qwen3"``) or a dict of :func:`reference.build_tiny_model` kwargs
(``{"arch": "llama", "tie_word_embeddings": True}``); default ``"llama"``.

Tests marked ``gpu`` are skipped when CUDA is unavailable.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import reference  # noqa: E402  (tests/support, on pytest's pythonpath)
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: loads the real SmolLM2-135M model")


def pytest_sessionstart(session):
    # The engine takes the C++ CPU kernels when they are built (scripts/setup.sh builds them);
    # building them here too (a no-op once built) makes every engine test run the path users get.
    from minivllm.ops import cpu_kernels

    cpu_kernels.build()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return reference.export_smollm2_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))


@dataclass
class _SmolLM2Export:
    hf_dir: Path
    prompt_ids: list[int]
    gguf_logits: torch.Tensor


@pytest.fixture(scope="session")
def _smollm2_export(tmp_path_factory, tokenizer_dir) -> _SmolLM2Export:
    from transformers import AutoTokenizer

    gguf_model = reference.load_smollm2_gguf_model()
    hf_dir = reference.export_smollm2_hf(
        tmp_path_factory.mktemp("smollm2-hf"), tokenizer_dir=tokenizer_dir, gguf_model=gguf_model
    )
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt_ids = list(
        tok.apply_chat_template(
            reference.SMOLLM2_CHECK_MESSAGES, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    with torch.inference_mode():
        logits = gguf_model(input_ids=torch.tensor([prompt_ids])).logits.float().clone()
    del gguf_model
    return _SmolLM2Export(hf_dir=hf_dir, prompt_ids=prompt_ids, gguf_logits=logits)


@pytest.fixture(scope="session")
def smollm2_hf_dir(_smollm2_export) -> Path:
    return _smollm2_export.hf_dir


@pytest.fixture(scope="session")
def smollm2_gguf_logits(_smollm2_export) -> tuple[list[int], torch.Tensor]:
    return _smollm2_export.prompt_ids, _smollm2_export.gguf_logits


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer_dir):
    cache: dict[str, Path] = {}

    def make(arch: str, **kw) -> Path:
        key = json.dumps({"arch": arch, **kw}, sort_keys=True, default=repr)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = reference.build_tiny_model(out, arch, tokenizer_dir, **kw)
        return cache[key]

    return make


@pytest.fixture
def tiny_model_dir(request, make_tiny_model) -> Path:
    param = getattr(request, "param", "llama")
    if isinstance(param, str):
        return make_tiny_model(param)
    if isinstance(param, dict):
        kw = dict(param)
        return make_tiny_model(kw.pop("arch"), **kw)
    raise TypeError(f"tiny_model_dir param must be an arch name or a dict, got {param!r}")
