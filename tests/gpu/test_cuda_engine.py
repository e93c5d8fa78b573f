"""The engine on CUDA as users run it (Triton paged attention, decode steps replayed from CUDA
graphs) against transformers on the same GPU: tiny random models in float32, prompts chunked
beside running decodes, greedy, vLLM's logprob criterion. Marked gpu: skipped without CUDA (run
by scripts/gpu_check.sh; tests/attention/test_triton_attention.py and
tests/worker/test_cuda_graph.py run on the GPU there too)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import model_runner
from reference import check_logprobs_close, hf_greedy, load_hf_model

from minivllm import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_matches_transformers_on_cuda(arch, make_tiny_model, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner
    model_dir = make_tiny_model(arch)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (3, 30, 70, 5, 12)]
    reference = [r.as_output() for r in hf_greedy(load_hf_model(model_dir).to("cuda"), prompts, 16)]
    llm = make_llm(model_dir, dtype="float32", device="cuda", max_num_batched_tokens=32, max_num_seqs=8)
    runner = model_runner(llm)
    assert runner.attn_backend.name == "TRITON_ATTN" and runner.graph_runner.recordings
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=16, logprobs=5), use_tqdm=False)
    check_logprobs_close(outputs_0=reference, outputs_1=[(o.outputs[0].token_ids, o.outputs[0].logprobs)
                                                         for o in outputs], name_0="hf", name_1="minivllm[cuda]")
