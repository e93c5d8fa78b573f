"""`minivllm bench broadcast` with tiny counts: both rounds (inline and overflow) print positive
percentiles, and the JSON file records which path each size took."""

from __future__ import annotations

import json
import re

from minivllm.entrypoints.cli import main

LINE = re.compile(
    r"Broadcast round trip, (\d+) B to 2 readers \((inline|overflow), 20 messages\): "
    r"p50 ([\d.]+) us, p99 ([\d.]+) us, mean ([\d.]+) us"
)


def test_bench_broadcast_prints_both_rounds(tmp_path, capsys):
    out = tmp_path / "broadcast.json"
    main(
        [
            "bench",
            "broadcast",
            "--num-messages",
            "20",
            "--num-warmup",
            "5",
            "--message-bytes",
            "512",
            "--max-chunk-bytes",
            "2048",
            "--output-json",
            str(out),
        ]
    )
    rounds = [LINE.fullmatch(line) for line in capsys.readouterr().out.splitlines()]
    assert all(rounds) and [(m[1], m[2]) for m in rounds] == [
        ("512", "inline"),
        ("4096", "overflow"),
    ]
    for m in rounds:
        p50, p99, mean = (float(x) for x in m.groups()[2:])
        assert 0 < p50 <= p99 and mean > 0
    result = json.loads(out.read_text())
    assert result["results"]["small"]["path"] == "inline"
    large = result["results"]["large"]
    assert (large["message_bytes"], large["path"]) == (4096, "overflow")
