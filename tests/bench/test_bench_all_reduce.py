"""`minivllm bench all-reduce` with tiny counts: every case is timed (positive percentiles), and
the per-forward figure is the call count (2 per layer + the embedding's) times the per-call
median, plus the logits gather for decode-sized steps, computed here from the JSON."""

from __future__ import annotations

import json
import re

from minivllm.entrypoints.cli import main


def test_bench_all_reduce_reports_every_case(tmp_path, capsys):
    out = tmp_path / "all_reduce.json"
    main(["bench", "all-reduce", "--num-iters", "5", "--rows", "1,64", "--num-layers", "3",
          "--hidden-size", "64", "--vocab-size", "256", "--output-json", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    ops = [(c["op"], c["rows"]) for c in report["cases"]]
    assert ops == [("all_reduce (shared memory)", 1), ("all_reduce (gloo)", 1), ("all_reduce (shared memory)", 64),
                   ("all_reduce (gloo)", 64), ("all_gather logits", 1)]
    assert all(0 < c["p50_us"] <= c["p99_us"] for c in report["cases"])
    shm = {c["rows"]: c["p50_us"] for c in report["cases"] if c["op"] == "all_reduce (shared memory)"}
    gather = report["cases"][-1]["p50_us"]
    steps = dict(re.findall(r"per forward of (\d+) rows: 7 all-reduces.* = ([\d.]+) ms", printed))
    assert float(steps["1"]) == round((7 * shm[1] + gather) / 1e3, 2)
    assert float(steps["64"]) == round(7 * shm[64] / 1e3, 2)
