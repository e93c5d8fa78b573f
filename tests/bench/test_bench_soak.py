"""`minivllm bench soak` (bench/soak.py) against a real server, in CI's short form: 16 streaming
clients for 60 s (the closing figures come from 200 clients for 10 minutes). Every request ends
with [DONE] and output, none is lost or hung, the server's RSS after warm-up (at least 20 s, and
until the engine has run the 16,384 tokens its KV cache of 1024 blocks holds: the cache's pages are
committed as they are first written) grows by less than 5%, and the engine is idle (no request, no
KV block held) once the load is gone."""

from __future__ import annotations

import argparse
import json

from server_utils import MODEL_NAME, TINY_SERVER_ARGS, RemoteServer

from minivllm.bench import soak


def test_soak(make_tiny_model, tmp_path):
    parser = argparse.ArgumentParser()
    soak.add_cli_args(parser)
    out = tmp_path / "soak.json"
    with RemoteServer(make_tiny_model("llama"), [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME,
                                                        "--num-gpu-blocks-override", "1024"]) as server:
        soak.main(parser.parse_args([
            "--host", "127.0.0.1", "--port", str(server.port), "--clients", "16", "--duration", "60",
            "--warmup", "20", "--input-len", "64", "--output-len", "48", "--request-timeout", "60",
            "--pid", str(server.proc.pid), "--output-json", str(out)]))
    report = json.loads(out.read_text())
    assert report["requests"] >= 16 and report["completed"] == report["requests"], report
    assert report["lost"] == report["hung"] == report["failed_with_error"] == 0, report
    assert 20 <= report["warmup_seconds"] < 60 and report["rss_growth_percent"] < 5.0, report
    assert report["idle_after"], report
