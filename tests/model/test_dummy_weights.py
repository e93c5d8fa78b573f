"""load_format="dummy" (model/loader.py): a model directory with a config and a tokenizer but no
weight files runs, on random weights uniform in [-1e-3, 1e-3]; without the option the missing
weights are an error, never silently random."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import model_runner

from minivllm import SamplingParams


def test_dummy_weights_need_no_checkpoint(make_tiny_model, make_llm, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner
    for path in make_tiny_model("llama").iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    with pytest.raises(ValueError, match="No \\*.safetensors files"):
        make_llm(tmp_path, dtype="float32")
    llm = make_llm(tmp_path, dtype="float32", load_format="dummy")
    params = torch.cat([p.flatten() for p in model_runner(llm).model.parameters()])
    assert params.abs().max() <= 1e-3 and params.std() > 1e-4  # uniform on [-a, a]: std a / sqrt(3)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
