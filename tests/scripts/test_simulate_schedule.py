"""scripts/simulate_schedule.py's clock against a hand computation: one prompt alone, no noise,
so its first token comes one prefill step after it arrives and its later tokens one decode step
apart, each step a + b x tokens + c x requests + d x attention pairs, plus e for the prompt's step."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate_schedule.py"


def load_script():
    spec = importlib.util.spec_from_file_location("simulate_schedule", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("max_step_ms", [None, 250.0])
def test_one_prompt_alone_takes_the_formulas_time(max_step_ms):
    a, b, c, d, e = 0.01, 0.001, 0.002, 1e-6, 0.005
    args = argparse.Namespace(request_rate=1.0, num_prompts=1, min_input_len=128, max_input_len=128, output_len=4,
                              burst_num_prompts=0, burst_input_len=1, burst_output_len=1, burst_delay=0.0,
                              a=a, b=b, c=c, d=d, e=e, sigma=0.0)
    figures = load_script().run(args, max_step_ms, seed=0)
    # The prompt's step: 128 tokens, token i attending to i + 1 keys. Then 3 decodes after 128,
    # 129 and 130 computed tokens. The cost model is not fitted before 16 steps: no budget yet.
    prefill = a + 128 * b + c + d * 128 * 129 / 2 + e
    decodes = [a + b + c + d * (n + 1) for n in (128, 129, 130)]
    assert figures["TTFT p50"] == pytest.approx(1e3 * prefill)
    assert figures["TPOT p50"] == pytest.approx(1e3 * sum(decodes) / 3)
    # numpy's percentile: 99% of the way through 3 sorted gaps is 98% from the 2nd to the 3rd.
    assert figures["ITL p99"] == pytest.approx(1e3 * (decodes[1] + 0.98 * (decodes[2] - decodes[1])))
