"""The step cost model against steps timed by a known formula, and the scheduler sizing prompt
chunks by it under a step-time budget (a fake clock: the formula's time for each step)."""

from __future__ import annotations

import random

import pytest
from core_utils import FakeWorker, create_requests, create_scheduler, step

from minivllm.config import default_max_step_ms
from minivllm.core.sched.scheduler import MIN_PREFILL_CHUNK
from minivllm.core.sched.step_cost import StepBudget, StepCostModel, StepShape
from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

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


def test_error_histogram_counts_only_predicted_steps():
    """|measured / predicted - 1| per step, from the first step the model predicted."""
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(model.MIN_OBSERVATIONS):
        shape = random_shape(rng)
        model.observe(shape, formula(shape))
    assert model.ready and model.error.count == 0
    shape = random_shape(rng)
    model.observe(shape, model.predict(shape) * 1.12)  # 12% over: the (0.1, 0.15] bucket
    model.observe(shape, model.predict(shape) * 0.99)  # 1% under: the first bucket
    assert model.error.count == 2 and model.error.total == pytest.approx(0.13)
    bounds = dict(model.error.cumulative())
    assert (bounds["0.02"], bounds["0.1"], bounds["0.15"]) == (1, 1, 2)


def run_prompts_under_budget(budget: float, slowdown: tuple[float, float], quiet_steps: int):
    """8 streams decode (warm-up: the model gets ready, then `quiet_steps` decode-only steps);
    then 12 prompts of 2000 tokens arrive. Each step takes the formula's time times a random
    factor in `slowdown`. Returns the scheduler, every step's time and where the prompts came."""
    rng = random.Random(3)
    scheduler = create_scheduler(max_num_batched_tokens=8192, max_model_len=4096, max_num_seqs=32,
                                 max_step_ms=budget * 1000)
    worker = FakeWorker()
    times: list[float] = []

    def slowed(shape: StepShape) -> float:
        times.append(formula(shape) * rng.uniform(*slowdown))
        return times[-1]

    for r in create_requests(8, prompt_len=64, max_tokens=800, ignore_eos=True):
        scheduler.add_request(r)
    for _ in range(StepCostModel.MIN_OBSERVATIONS + quiet_steps):
        step(scheduler, worker, step_seconds=slowed)
    prompts = create_requests(12, prompt_len=2000, max_tokens=2, ignore_eos=True, start_index=8)
    for r in prompts:
        scheduler.add_request(r)
    start = len(times)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in prompts):
        step(scheduler, worker, step_seconds=slowed)
    return scheduler, times, start


def test_a_prompt_after_quiet_steps_may_use_the_whole_budget_then_steps_average_sixty_percent():
    """The two bounds of StepBudget with an exact model: the first prompt step after decode-only
    steps (each ~10 ms) takes more than 60% of the budget and no more than all of it; under the
    sustained load that follows, every 4 consecutive steps average at most 60% of it (plus, when
    the window is used up, what a step runs anyway: its decodes and MIN_PREFILL_CHUNK prompt
    tokens)."""
    budget = 0.060
    scheduler, times, start = run_prompts_under_budget(budget, (1.0, 1.0), quiet_steps=8)
    decode_step = max(times[start - 3:start])
    assert decode_step < 0.015
    sustained = StepBudget.SUSTAINED_FRACTION * budget  # 60%
    assert sustained < times[start] <= budget
    assert max(times[start:]) <= budget + 1e-9
    assert scheduler.num_steps_over_budget == sum(t > budget for t in times) == 1  # the first prefill
    windows = [sum(times[i - 3:i + 1]) for i in range(start, len(times))]
    floor_cost = MIN_PREFILL_CHUNK * (WEIGHTS[1] + 2000 * WEIGHTS[3])
    assert max(windows) <= 4 * sustained + decode_step + floor_cost
    assert len(windows) > 12 * 2000 * 5e-4 / budget  # the prompts were split by time


def test_steps_slower_than_the_fit_are_kept_within_budget_by_the_margin():
    """Steps take 0-20% longer than the formula at random (a fit lands near +10%, so about half
    the steps planned at the budget would overrun it): the budget divides its allowance by the
    90th percentile of the overruns it saw. After the first steps fill that window, at most 3% of
    the steps run over the budget (about 7% do without the margin), none by more than 5%, and the
    scheduler counts exactly the steps over it."""
    budget = 0.060
    scheduler, times, start = run_prompts_under_budget(budget, (1.0, 1.2), quiet_steps=4)
    assert scheduler.step_budget.margin > 1.05
    assert scheduler.num_steps_over_budget == sum(t > budget for t in times)
    warm = range(start + StepBudget.MARGIN_WINDOW // 4, len(times))
    assert len(warm) > 100
    assert sum(times[i] > budget for i in warm) <= 0.03 * len(warm)
    assert max(times[i] for i in warm) <= 1.05 * budget


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_step_ms must be > 0"):
        create_scheduler(max_step_ms=0)
    with pytest.raises(ValueError, match="max_step_ms sizes prompt chunks: it needs enable_chunked_prefill"):
        create_scheduler(max_step_ms=50, enable_chunked_prefill=False, max_num_batched_tokens=128)


def test_default_budget_by_usage_and_device(make_tiny_model):
    """250 ms when serving on CPU; off offline, on CUDA, with chunked prefill off, or at 0."""
    model = str(make_tiny_model("llama"))

    def budget(cls: type[EngineArgs], **kwargs) -> float | None:
        return cls(model=model, device="cpu", **kwargs).create_engine_config().scheduler_config.max_step_ms

    assert budget(AsyncEngineArgs) == 250.0 and budget(EngineArgs) is None
    assert budget(AsyncEngineArgs, max_step_ms=0) is None and budget(EngineArgs, max_step_ms=80) == 80
    assert budget(AsyncEngineArgs, enable_chunked_prefill=False) is None
    assert default_max_step_ms("cuda", serving=True) is None
    with pytest.raises(ValueError, match="max_step_ms must be > 0"):
        budget(AsyncEngineArgs, max_step_ms=-5)
