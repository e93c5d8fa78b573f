"""Trace files (trace_dir): valid Chrome trace-event JSON whose phases agree with the engine.

One scripted offline workload on the tiny Llama (float32, a 32-token step budget, a 20-block KV
cache, prefix caching off so every prefill is the request's own): first a lone 100-token prompt
(chunked into ceil(100 / 32) = 4 chunks, nothing else in its steps), then six requests that do
not fit the cache together (preemptions). The trace is read back after shutdown and compared
with the engine's own counters and each request's front-end metrics.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from minivllm import SamplingParams
from minivllm.engine.tracing import load_trace, summarize
from minivllm.entrypoints.cli import main as cli_main

BUDGET = 32
LONE_PROMPT_LEN = 100
REQUIRED_KEYS = {
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "i": {"name", "ph", "ts", "pid", "tid", "s"},
    "M": {"name", "ph", "pid", "tid", "args"},
}


@pytest.fixture(scope="module")
def traced_run(make_tiny_model, make_module_llm, tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("traces")
    llm = make_module_llm(make_tiny_model("llama"), dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8,
                          num_gpu_blocks_override=20, max_model_len=256, enable_prefix_caching=False,
                          trace_dir=str(trace_dir))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lone = llm.generate([{"prompt_token_ids": [5 + i % 300 for i in range(LONE_PROMPT_LEN)]}], params, use_tqdm=False)
    busy_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    busy = llm.generate([{"prompt_token_ids": [7 + (i * 13 + j) % 500 for j in range(60)]} for i in range(6)],
                        busy_params, use_tqdm=False)
    num_preemptions = llm.llm_engine.get_scheduler_stats().num_preemptions
    llm.llm_engine.shutdown()
    (path,) = Path(trace_dir).glob("*.json")
    return path, lone + busy, num_preemptions


def _tracks(trace):
    """Request id -> its track's events in time order (instants after slices at equal times).
    Tracks are named by engine-core id, the request id and its registration ("0-0")."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] in ("X", "i") and names[event["tid"]].startswith("request "):
            tracks[names[event["tid"]].removeprefix("request ").rsplit("-", 1)[0]].append(event)
    return {k: sorted(v, key=lambda e: (e["ts"], e["ph"] == "i")) for k, v in tracks.items()}


def test_trace_is_valid_trace_event_json(traced_run):
    path, _, _ = traced_run
    trace = load_trace(str(path))
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    for event in trace["traceEvents"]:
        assert REQUIRED_KEYS[event["ph"]] <= set(event), event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
    # Every step phase lies inside its step slice.
    engine = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0), key=lambda e: e["ts"])
    steps = [e for e in engine if e["name"] == "step"]
    phases = Counter(e["name"] for e in engine)
    assert phases["schedule"] == phases["execute"] == phases["output"] == len(steps) > 0
    assert phases["prepare inputs"] == phases["forward"] == phases["sample"] == len(steps)
    for phase in engine:
        parent = next(s for s in reversed(steps) if s["ts"] <= phase["ts"])
        assert phase["ts"] + phase["dur"] <= parent["ts"] + parent["dur"] + 1e-3, (phase, parent)


def test_trace_phases_agree_with_the_engine(traced_run):
    path, outputs, num_preemptions = traced_run
    tracks = _tracks(load_trace(str(path)))
    assert set(tracks) == {o.request_id for o in outputs}
    # The lone prompt ran alone: a full budget per chunk.
    lone = tracks[outputs[0].request_id]
    assert [e["name"] for e in lone] == (["waiting"] + ["prefill chunk"] * math.ceil(LONE_PROMPT_LEN / BUDGET)
                                         + ["first token", "decode", "finished"])
    assert [e["args"]["tokens"] for e in lone if e["name"] == "prefill chunk"] == [32, 32, 32, 4]
    # Preemptions: as many preempted spans as the engine counted (and there were some).
    preempted = sum(e["name"] == "preempted" for events in tracks.values() for e in events)
    assert preempted == num_preemptions > 0
    for output in outputs:
        events = tracks[output.request_id]
        names = [e["name"] for e in events]
        metrics = output.metrics
        assert names[0] == "waiting" and names[-1] == "finished" and names.count("first token") == 1
        assert events[0]["ts"] == pytest.approx(metrics.arrival_time * 1e6, abs=1)
        # The engine's first token precedes the front end's by the output's trip, no more.
        first = events[names.index("first token")]["ts"] / 1e6
        assert metrics.arrival_time < first <= metrics.first_token_time < first + 1.0
        assert events[-1]["args"] == {"reason": "length", "output_len": len(output.outputs[0].token_ids)}
        # Each preemption is followed by a recomputation from token 0 (no prefix cache).
        for i, name in enumerate(names):
            if name == "preempted":
                assert names[i + 1] == "prefill chunk"


def test_trace_summarize_cli(traced_run, capsys):
    path, outputs, _ = traced_run
    rows = {name: (count, total, mean) for name, count, total, mean in summarize(load_trace(str(path)))}
    assert rows["finished"][0] == rows["first token"][0] == len(outputs)
    cli_main(["trace", "summarize", str(path)])
    printed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert int(printed["step"][1]) == rows["step"][0]
    assert float(printed["forward"][2]) == pytest.approx(rows["forward"][1], abs=1e-3)
