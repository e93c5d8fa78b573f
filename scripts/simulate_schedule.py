"""W3's arrivals through the real Scheduler on a simulated clock: what a scheduling policy does to
TTFT, TPOT and ITL with the machine's noise taken out. Poisson arrivals (all at once at rate 0),
prompts uniform in [min, max] tokens, every request `--output-len` tokens, and optionally the
burst of `bench serve` (`--burst-num-prompts` prompts at `--burst-delay` s); each step takes
a + b x tokens + c x requests + d x attention pairs seconds (StepCostModel's features; a
least-squares fit of a real run's step times gives the weights), plus e for a step with prompt
tokens (it runs eagerly on the dense weights where a decode-only step replays the trace on the
codes), times a log-normal factor of sigma; percentiles as `bench serve` takes them (numpy's). Each setting runs the same arrivals
and noise per seed. Run from the repository root (docs/PERFORMANCE.md, "Serving under load"):

    .venv/bin/python scripts/simulate_schedule.py --request-rate 0.9 --a 0.03 --b 0.0012 --c 0.002
    .venv/bin/python scripts/simulate_schedule.py --request-rate 0 --num-prompts 16 --min-input-len 128 \
        --max-input-len 128 --output-len 384 --burst-num-prompts 20     # the burst workload
"""

import argparse
import math
import random
import statistics
import sys

import numpy as np

sys.path.insert(0, "tests/support")
from core_utils import create_scheduler  # noqa: E402

from minivllm.core.outputs import ModelRunnerOutput  # noqa: E402
from minivllm.core.request import Request  # noqa: E402
from minivllm.core.sched.step_cost import StepBudget  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402


def run(args: argparse.Namespace, max_step_ms: float | None, seed: int) -> dict[str, float]:
    """One simulated serving run; latencies in ms."""
    rng, noise = random.Random(seed), random.Random(seed + 1)
    weights = (args.a, args.b, args.c, args.d)
    scheduler = create_scheduler(num_blocks=4096, max_num_seqs=256, max_model_len=2048, max_step_ms=max_step_ms)
    arrivals, t = [], 0.0
    for _ in range(args.num_prompts):
        t += rng.expovariate(args.request_rate) if args.request_rate > 0 else 0.0
        arrivals.append((t, rng.randint(args.min_input_len, args.max_input_len), args.output_len))
    arrivals += [(args.burst_delay, args.burst_input_len, args.burst_output_len)] * args.burst_num_prompts
    arrivals.sort(key=lambda arrival: arrival[0])
    clock, next_arrival = 0.0, 0
    arrived, first, last, num_tokens, gaps = {}, {}, {}, {}, []
    while next_arrival < len(arrivals) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, arrivals[next_arrival][0])
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= clock:
            at, length, output_len = arrivals[next_arrival]
            req_id = str(next_arrival)
            prompt = [100 + (next_arrival * 7 + j) % 900 for j in range(length)]
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            scheduler.add_request(Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                                          eos_token_id=2, arrival_time=at))
            arrived[req_id] = at
            next_arrival += 1
        output = scheduler.schedule()
        shape = scheduler.last_step_shape
        seconds = sum(w * f for w, f in zip(weights, shape.features(), strict=True))
        if shape.num_tokens > shape.num_reqs:  # some request computes more than one token: a prompt
            seconds += args.e
        seconds *= math.exp(noise.gauss(0.0, args.sigma))
        req_ids = list(output.num_scheduled_tokens)
        sampled = [[1000] if (r := scheduler.requests[i]).num_computed_tokens >= r.num_tokens else [] for i in req_ids]
        clock += seconds
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))
        scheduler.observe_step_time(seconds)
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            if not tokens:
                continue
            if req_id in first:
                gaps.append(clock - last[req_id])
            first.setdefault(req_id, clock)
            last[req_id] = clock
            num_tokens[req_id] = num_tokens.get(req_id, 0) + 1
    ttft = [first[r] - arrived[r] for r in first]
    tpot = [(last[r] - first[r]) / (num_tokens[r] - 1) for r in first if num_tokens[r] > 1]
    figures = {f"{name} p{q}": 1e3 * float(np.percentile(values, q))
               for name, values in (("TTFT", ttft), ("TPOT", tpot)) for q in (50, 99)}
    return figures | {"ITL p99": 1e3 * float(np.percentile(gaps, 99)), "output tok/s": sum(num_tokens.values()) / clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--min-input-len", type=int, default=128)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--burst-num-prompts", type=int, default=0)
    parser.add_argument("--burst-input-len", type=int, default=1000)
    parser.add_argument("--burst-output-len", type=int, default=32)
    parser.add_argument("--burst-delay", type=float, default=3.0)
    parser.add_argument("--a", type=float, default=0.012, help="seconds per step")
    parser.add_argument("--b", type=float, default=0.0006, help="seconds per token")
    parser.add_argument("--c", type=float, default=0.0003, help="seconds per request")
    parser.add_argument("--d", type=float, default=6e-7, help="seconds per attention pair")
    parser.add_argument("--e", type=float, default=0.0, help="seconds more for a step with prompt tokens")
    parser.add_argument("--sigma", type=float, default=0.08, help="log-normal noise of each step's time")
    parser.add_argument("--max-step-ms", default="0,250", help="settings to compare (0: off)")
    parser.add_argument("--sustained-fraction", type=float, default=StepBudget.SUSTAINED_FRACTION,
                        help="StepBudget.SUSTAINED_FRACTION to simulate")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    StepBudget.SUSTAINED_FRACTION = args.sustained_fraction
    for setting in args.max_step_ms.split(","):
        max_step_ms = float(setting) or None
        runs = [run(args, max_step_ms, seed) for seed in range(args.seeds)]
        figures = "  ".join(f"{k} " + "/".join(f"{r[k]:.0f}" for r in runs) for k in runs[0])
        print(f"max_step_ms {setting}: {figures}  (median TTFT p50 {statistics.median(r['TTFT p50'] for r in runs):.0f})")


if __name__ == "__main__":
    main()
