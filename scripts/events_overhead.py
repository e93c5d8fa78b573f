"""Per-step cost of the engine's event collector and tracer, without a model: 64 requests
decoding (after their prefill), a 4096-block pool, the fake worker of tests/support/core_utils.py.
The model's part of each step is not timed; the rest (schedule, update_from_output, and the
events and the trace when on) is. Run from the repository root (docs/PERFORMANCE.md):

    .venv/bin/python scripts/events_overhead.py
"""

import sys
import tempfile
import time

sys.path.insert(0, "tests/support")
from core_utils import FakeWorker, create_requests, create_scheduler  # noqa: E402

from minivllm.core.events import EventCollector  # noqa: E402
from minivllm.engine.tracing import StepTracer  # noqa: E402


def run(collect: bool, trace: bool, steps: int = 300) -> float:
    scheduler = create_scheduler(num_blocks=4096, max_num_seqs=64, max_model_len=1024, enable_prefix_caching=True)
    worker, collector = FakeWorker(), EventCollector(scheduler) if collect else None
    tracer = StepTracer(tempfile.mkdtemp(), "bench") if trace else None
    for r in create_requests(64, prompt_len=300, max_tokens=10_000):
        scheduler.add_request(r)
    spent = 0.0
    for i in range(steps):
        t0 = time.perf_counter_ns()
        so = scheduler.schedule()
        t1 = time.perf_counter_ns()
        mro = worker.execute_model(so, scheduler)  # not timed: the model's part
        t = time.perf_counter_ns() - (t1 - t0)
        outs = scheduler.update_from_output(so, mro)
        if collector:
            collector.on_schedule(so, 0.0)
            ev = collector.on_step_end(outs)
            if tracer:
                tracer.record(ev, [0, 1, 2, 3], [0, 1, 2, 3])
        if i >= 20:  # decode steady state
            spent += time.perf_counter_ns() - t
    if tracer:
        tracer.close()
    return spent / (steps - 20) / 1e3

base = min(run(False, False) for _ in range(3))
events = min(run(True, False) for _ in range(3))
traced = min(run(True, True) for _ in range(3))
print(f"schedule + update_from_output alone {base:.0f} us/step; + events {events - base:.0f} us; + events and trace {traced - base:.0f} us")
