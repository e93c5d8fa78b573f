"""Chrome trace-event JSON of the engine core (the "traceEvents" format Perfetto and
chrome://tracing open): the steps on the engine's track, each request on its own.

The engine track (tid 0) holds one complete slice ("ph": "X") per step with its phases as
children: schedule, execute (prepare inputs, forward, sample: timed by the model runner) and
output (update_from_output and the events). Each request gets a track (its own tid, named by a
thread_name metadata event) with its phases, built from the step's EngineEvents
(core/events.py): waiting (arrival to first admission), each prefill chunk, first token (an
instant event), decode (one slice per run of consecutive decode steps), preempted (preemption to
readmission), finished (an instant event, its reason in args).

The file is written as the engine runs, a batch of events at a time (at most FLUSH_EVENTS held
in memory), and closed at shutdown. A file cut short (a killed engine) lacks only its closing
brackets, which the trace viewers accept and summarize() adds back.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgspec

from minivllm.core.events import EngineEvents

FLUSH_EVENTS = 4096
ENGINE_TID = 0


def _us(seconds: float) -> float:
    return seconds * 1e6


@dataclass
class _Track:
    tid: int
    wait_phase: str | None  # "waiting" or "preempted" while not running, since wait_since
    wait_since: float
    decode_start: float | None = None  # the open run of decode steps
    decode_end: float = 0.0
    decode_steps: int = 0


class StepTracer:
    """Turns each step's EngineEvents and phase times into trace events, written to one file."""

    def __init__(self, trace_dir: str, name: str) -> None:
        os.makedirs(trace_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = os.path.join(trace_dir, f"minivllm-trace-{name}-{stamp}-{os.getpid()}.json")
        self._file = open(self.path, "w")  # noqa: SIM115 (open for the engine's lifetime)
        self._file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._first = True
        self._encoder = msgspec.json.Encoder()
        self.pid = os.getpid()
        self._buffer: list[dict[str, Any]] = []
        self._tracks: dict[str, _Track] = {}
        self._next_tid = ENGINE_TID + 1
        self._meta(ENGINE_TID, f"engine core ({name})")
        self._buffer.append({"ph": "M", "name": "process_name", "pid": self.pid, "tid": ENGINE_TID,
                             "args": {"name": f"minivllm {name}"}})

    def _meta(self, tid: int, name: str) -> None:
        self._buffer.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "args": {"name": name}})
        self._buffer.append({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid,
                             "args": {"sort_index": tid}})

    def _slice(self, tid: int, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"ph": "X", "name": name, "pid": self.pid, "tid": tid, "ts": _us(start),
                                 "dur": max(_us(end - start), 0.0)}
        if args:
            event["args"] = args
        self._buffer.append(event)

    def _instant(self, tid: int, name: str, at: float, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"ph": "i", "s": "t", "name": name, "pid": self.pid, "tid": tid, "ts": _us(at)}
        if args:
            event["args"] = args
        self._buffer.append(event)

    def _track(self, req_id: str, since: float) -> _Track:
        track = self._tracks.get(req_id)
        if track is None:
            track = self._tracks[req_id] = _Track(self._next_tid, "waiting", since)
            self._next_tid += 1
            self._meta(track.tid, f"request {req_id}")
        return track

    def _close_decode(self, track: _Track) -> None:
        if track.decode_start is not None:
            self._slice(track.tid, "decode", track.decode_start, track.decode_end, {"steps": track.decode_steps})
            track.decode_start = None

    def record(self, events: EngineEvents, phase_ns: list[int] | None, runner_ns: list[int] | None) -> None:
        """One step: its events and, for a step that ran (step >= 0), the engine core's phase
        boundaries [start, scheduled, executed, end] and the model runner's [start, prepared,
        forwarded, sampled] (perf_counter_ns; None when the step ran no model)."""
        start, end = events.start, events.end
        if events.step >= 0 and phase_ns is not None:
            self._record_step(events, phase_ns, runner_ns)
        for arrived in events.arrived:
            self._track(arrived.id, arrived.arrival)
        for chunk in events.scheduled:
            track = self._track(chunk.id, start)
            if track.wait_phase is not None:
                self._slice(track.tid, track.wait_phase, track.wait_since, start)
                track.wait_phase = None
            if chunk.prefill:
                self._close_decode(track)
                self._slice(track.tid, "prefill chunk", start, end, {"tokens": chunk.tokens, "computed": chunk.computed})
            else:
                if track.decode_start is None:
                    track.decode_start, track.decode_steps = start, 0
                track.decode_end = end
                track.decode_steps += 1
        for req_id in events.first_token:
            self._instant(self._track(req_id, start).tid, "first token", end)
        for req_id in events.preempted:
            track = self._track(req_id, start)
            self._close_decode(track)
            track.wait_phase, track.wait_since = "preempted", start
        for finished in events.finished:
            track = self._track(finished.id, start)
            self._close_decode(track)
            if track.wait_phase is not None:  # aborted before it ran again
                self._slice(track.tid, track.wait_phase, track.wait_since, end)
            self._instant(track.tid, "finished", end, {"reason": finished.reason, "output_len": finished.output_len})
            del self._tracks[finished.id]
        if len(self._buffer) >= FLUSH_EVENTS:
            self.flush()

    def _record_step(self, events: EngineEvents, phase_ns: list[int], runner_ns: list[int] | None) -> None:
        start, scheduled, executed, end = (ns / 1e9 for ns in phase_ns)
        self._slice(ENGINE_TID, "step", start, end, {
            "step": events.step, "prefill_tokens": events.num_prefill_tokens,
            "decode_tokens": events.num_decode_tokens, "running": len(events.running),
            "waiting": len(events.waiting), "preempted": len(events.preempted)})
        self._slice(ENGINE_TID, "schedule", start, scheduled)
        self._slice(ENGINE_TID, "execute", scheduled, executed)
        if runner_ns is not None:
            run_start, prepared, forwarded, sampled = (ns / 1e9 for ns in runner_ns)
            self._slice(ENGINE_TID, "prepare inputs", run_start, prepared)
            self._slice(ENGINE_TID, "forward", prepared, forwarded)
            self._slice(ENGINE_TID, "sample", forwarded, sampled)
        self._slice(ENGINE_TID, "output", executed, end)

    def flush(self) -> None:
        if not self._buffer:
            return
        encoded = ",\n".join(self._encoder.encode(e).decode() for e in self._buffer)
        self._file.write(encoded if self._first else ",\n" + encoded)
        self._first = False
        self._buffer.clear()
        self._file.flush()

    def close(self) -> None:
        """Close the requests' open decode runs and the file."""
        for track in self._tracks.values():
            self._close_decode(track)
        self.flush()
        self._file.write("\n]}\n")
        self._file.close()


def load_trace(path: str) -> dict[str, Any]:
    """A trace file, also one cut short (an engine killed before closing it)."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.rstrip().rstrip(",") + "\n]}")


def summarize(trace: dict[str, Any]) -> list[tuple[str, int, float, float]]:
    """(phase, count, total ms, mean ms) per slice name, then (name, count, 0, 0) per instant
    event name, in order of first appearance."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in trace["traceEvents"]:
        if event["ph"] in ("X", "i"):
            entry = totals[event["name"]]
            entry[0] += 1
            entry[1] += event.get("dur", 0.0) / 1000
    return [(name, int(count), total, total / count) for name, (count, total) in totals.items()]


def print_summary(path: str) -> None:
    rows = summarize(load_trace(path))
    print(f"{'phase':<16} {'count':>8} {'total ms':>12} {'mean ms':>10}")
    for name, count, total, mean in rows:
        print(f"{name:<16} {count:>8} {total:>12.3f} {mean:>10.3f}")
