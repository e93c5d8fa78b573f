"""The step cost model against steps timed by a known formula, and the scheduler sizing prompt
chunks by it under a step-time budget (a fake clock: the formula's time for each step)."""

from __future__ import annotations

import random

import pytest
from core_utils import FakeWorker, create_requests, create_scheduler, step

from minivllm.core.sched.scheduler import MIN_PREFILL_CHUNK
from minivllm.core.sched.step_cost import StepCostModel, StepShape

# Seconds: 4 ms fixed, 0.5 ms a token, 0.3 ms a request, 2 ns an attention pair.
WEIGHTS = (4e-3, 5e-4, 3e-4, 2e-9)


def formula(shape: StepShape) -> float:
    return sum(w * f for w, f in zip(WEIGHTS, shape.features(), strict=True))


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(1, 12)):
        shape.add(rng.randint(0, 2000), rng.choice([1, 1, 1, rng.randint(2, 600)]))
    return shape


def test_attention_pairs_by_hand():
    shape = StepShape()
    shape.add(num_computed=0, num_new=3)  # 1 + 2 + 3
    shape.add(num_computed=10, num_new=1)  # 11
    assert (shape.num_tokens, shape.num_reqs, shape.num_attention_pairs) == (4, 2, 17)
    shape.add(10, 1, sign=-1)
    assert (shape.num_tokens, shape.num_reqs, shape.num_attention_pairs) == (3, 1, 6)


def test_fits_noisy_steps_within_five_percent():
    rng = random.Random(0)
    model = StepCostModel()
    for i in range(model.MIN_OBSERVATIONS - 1):
        shape = random_shape(rng)
        model.observe(shape, formula(shape))
        assert not model.ready, i
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, formula(shape) * rng.uniform(0.9, 1.1))  # +-10% noise
    assert model.ready and all(w >= 0 for w in model.weights)
    errors = []
    for _ in range(200):
        shape = random_shape(rng)
        errors.append(abs(model.predict(shape) / formula(shape) - 1))
    assert max(errors) < 0.05, max(errors)


def test_weights_stay_non_negative():
    """Times that do not grow with the requests (their true weight is 0, noise may pull it below)."""
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.observe(shape, 2e-3 + 4e-4 * shape.num_tokens + rng.uniform(-1e-4, 1e-4))
    assert all(w >= 0 for w in model.weights)
    assert model.weights[1] == pytest.approx(4e-4, rel=0.02)


def timed_step(scheduler, worker):
    so, _ = step(scheduler, worker, step_seconds=formula)
    return so, formula(scheduler.last_step_shape)


def test_budget_sizes_prompt_chunks_and_decodes_run_every_step():
    """16 streams decode; a 3000-token prompt arrives. With a 60 ms budget its chunks keep each
    step within the budget (the model is exact: the steps follow the formula), the 16 decodes
    run in every step, and the chunks add up to the prompt."""
    scheduler = create_scheduler(max_num_batched_tokens=8192, max_model_len=4096, max_num_seqs=32,
                                 max_step_ms=60)
    worker = FakeWorker()
    streams = create_requests(16, prompt_len=64, max_tokens=400, ignore_eos=True)
    for r in streams:
        scheduler.add_request(r)
    for _ in range(StepCostModel.MIN_OBSERVATIONS + 4):  # warm-up: prefills, then decodes
        timed_step(scheduler, worker)
    (long,) = create_requests(1, prompt_len=3000, max_tokens=2, ignore_eos=True, start_index=16)
    scheduler.add_request(long)
    chunks = []
    while long.num_computed_tokens < 3000:
        so, seconds = timed_step(scheduler, worker)
        assert all(so.num_scheduled_tokens.get(r.request_id) == 1 for r in streams)
        chunks.append(so.num_scheduled_tokens.get("16", 0))
        assert seconds <= 0.060 + 1e-9
    assert sum(chunks) == 3000 and len(chunks) > 3000 * 5e-4 / 0.060  # it was split by time
    assert all(c > 0 for c in chunks)


def test_prompts_advance_when_decodes_fill_the_budget():
    """A budget the decodes alone exceed: each step still takes MIN_PREFILL_CHUNK prompt tokens."""
    scheduler = create_scheduler(max_model_len=1024, max_num_seqs=32, max_step_ms=5)
    worker = FakeWorker()
    for r in create_requests(16, prompt_len=8, max_tokens=300, ignore_eos=True):
        scheduler.add_request(r)
    for _ in range(StepCostModel.MIN_OBSERVATIONS + 2):
        timed_step(scheduler, worker)
    (prompt,) = create_requests(1, prompt_len=100, max_tokens=2, ignore_eos=True, start_index=16)
    scheduler.add_request(prompt)
    so, seconds = timed_step(scheduler, worker)
    assert seconds > 0.005 and so.num_scheduled_tokens["16"] == MIN_PREFILL_CHUNK


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_step_ms must be > 0"):
        create_scheduler(max_step_ms=0)
    with pytest.raises(ValueError, match="max_step_ms sizes prompt chunks: it needs enable_chunked_prefill"):
        create_scheduler(max_step_ms=50, enable_chunked_prefill=False, max_num_batched_tokens=128)
