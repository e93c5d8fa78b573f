"""Request-scoped errors inside the engine core: a request whose sampling raises (forced here by
a sampling-parameter hook that raises for one request's rows) fails alone, with the error as its
stop reason, while the requests beside it in the same steps go on and produce exactly what they
produce without it (greedy, and seeded random: the failed tries do not consume their random
numbers); the engine keeps serving and holds no block afterwards."""

from __future__ import annotations

import pytest
from engine_utils import engine_core

from minivllm import SamplingParams
from minivllm.engine.exceptions import EngineDeadError
from minivllm.worker.sampling_batch import SamplingBatch

POISON_SEED = 13


def _requests(with_poisoned: bool) -> tuple[list[dict], list[SamplingParams]]:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8, ignore_eos=True)]
    if not with_poisoned:
        prompts, params = prompts[:-1], params[:-1]
    return [{"prompt_token_ids": p} for p in prompts], params


def _tokens(outputs) -> list[tuple[list[int], str | None]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


def test_a_request_whose_sampling_raises_fails_alone(make_tiny_model, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # the hook must run in the engine
    llm = make_llm(make_tiny_model("llama"), dtype="float32")
    expected = _tokens(llm.generate(*_requests(with_poisoned=False), use_tqdm=False))

    make_metadata = SamplingBatch.make_metadata

    def poisoned(self, rows, draft_prefixes=None):
        if any(self.params[row].seed == POISON_SEED for row in rows.tolist()):
            raise RuntimeError("a logits processor failed")
        return make_metadata(self, rows, draft_prefixes)

    monkeypatch.setattr(SamplingBatch, "make_metadata", poisoned)
    outputs = llm.generate(*_requests(with_poisoned=True), use_tqdm=False)
    assert _tokens(outputs[:3]) == expected
    failed = outputs[3].outputs[0]
    assert failed.token_ids == [] and failed.finish_reason == "abort"
    assert failed.stop_reason == "sampling failed: RuntimeError: a logits processor failed"

    # The engine goes on, and every block the failed request held is back.
    monkeypatch.setattr(SamplingBatch, "make_metadata", make_metadata)
    assert _tokens(llm.generate(*_requests(with_poisoned=False), use_tqdm=False)) == expected
    scheduler = engine_core(llm).scheduler
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0


def test_an_error_no_single_request_raises_is_not_request_scoped(make_tiny_model, make_llm, monkeypatch):
    """A batch-wide failure (here: every sampling call raises, for each of three requests alone
    too) is not blamed on the requests: it propagates, and the engine stops rather than failing
    every request it will ever get."""
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    llm = make_llm(make_tiny_model("llama"), dtype="float32")

    def broken(self, rows, draft_prefixes=None):
        raise RuntimeError("the sampler is broken")

    monkeypatch.setattr(SamplingBatch, "make_metadata", broken)
    with pytest.raises(Exception, match="the sampler is broken"):
        llm.generate(*_requests(with_poisoned=False), use_tqdm=False)
    with pytest.raises(EngineDeadError, match="the sampler is broken"):
        llm.llm_engine.get_scheduler_stats()
