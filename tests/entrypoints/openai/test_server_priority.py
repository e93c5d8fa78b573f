"""`minivllm serve --scheduling-policy priority`: a request's `priority` (vLLM's extra field)
orders the waiting queue, on both routes."""

from __future__ import annotations

import threading
import time

from server_utils import MODEL_NAME, TINY_SERVER_ARGS, RemoteServer, wait_for


def test_higher_priority_overtakes_in_the_queue(tiny_llama_dir):
    args = [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME, "--scheduling-policy", "priority",
            "--max-num-seqs", "1"]
    with RemoteServer(tiny_llama_dir, args) as server:
        finished: list[str] = []

        def send(name: str, route: str, body: dict) -> None:
            response = server.post(route, {"model": MODEL_NAME, "max_tokens": 200, "ignore_eos": True, **body})
            assert response.status_code == 200, response.text
            finished.append(name)

        # The one seat is taken by a long request (1000 tokens, ~1 s or more for the tiny model);
        # the others are sent as soon as its first token streams back (a metrics poll could see
        # it running too late: once its queue was counted it had finished). Four wait behind it,
        # each sent with a better (lower) priority than the one before, on alternating routes.
        # Each runs 200 steps (tenths of a second), so one response cannot overtake another on its
        # way to its thread: the order they finish in is the order they ran in.
        first_token = threading.Event()

        def block() -> None:
            stream = server.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1000,
                                                        stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                first_token.set()
            finished.append("blocker")

        blocker = threading.Thread(target=block)
        blocker.start()
        assert first_token.wait(30.0)
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        waiting = [
            threading.Thread(target=send, args=("A", "v1/completions", {"prompt": "Hey", "priority": 3})),
            threading.Thread(target=send, args=("B", "v1/chat/completions", {**chat, "priority": 1})),
            threading.Thread(target=send, args=("C", "v1/completions", {"prompt": "Hey", "priority": -1})),
            threading.Thread(target=send, args=("D", "v1/chat/completions", {**chat, "priority": -2})),
        ]
        for thread in waiting:
            thread.start()
            time.sleep(0.01)
        assert wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == 4, 30.0)
        for thread in [blocker, *waiting]:
            thread.join(timeout=120)
        assert finished == ["blocker", "D", "C", "B", "A"]
