"""/dashboard in a real headless browser (Debian's chromium + chromedriver, through selenium),
against one tiny-Llama server with a small KV cache (39 usable blocks of 16 tokens) and four
seats (--max-num-seqs 4), so that concurrent requests wait and preempt each other, and an API
key, which the page takes from its URL and sends as a header.

The page is read through its DOM (stable ids and data attributes) and checked against the
server's own /metrics and against what the test sent: requests appear in the queues and the
timeline, prefix-sharing requests show shared blocks, the block map agrees with the KV cache
usage of the same message, and once the engine is idle the page's counters equal /metrics.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_utils import MODEL_NAME, TINY_SERVER_ARGS, RemoteServer, wait_for

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (scripts/setup.sh installs them as root)")

NUM_BLOCKS = 40
CROWDS = 3
API_KEY = "dashboard-key"
SERVER_ARGS = [a for a in TINY_SERVER_ARGS if a not in ("--max-model-len", "1024")] + [
    "--served-model-name", MODEL_NAME, "--max-model-len", "256", "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--max-num-seqs", "4"]
# The page's state read in one script run, so that values of one message are compared together.
READ_PAGE = """
const d = (id) => document.getElementById(id).dataset;
const rows = [...document.querySelectorAll('#timeline-svg .tl-row')].map((g) => ({
  id: g.dataset.requestId, status: g.dataset.status, reason: g.dataset.finishReason,
  preemptions: +g.dataset.preemptions, chunks: +g.dataset.prefillChunks}));
const ids = (q) => [...document.querySelectorAll(q + ' li')].map((li) => li.dataset.requestId);
return {running: +d('stat-running').value, waiting: +d('stat-waiting').value,
        preemptions: +d('stat-preemptions').value, kv: +d('stat-kv-usage').value,
        steps: +d('stat-steps').value, map: {...d('block-map')}, rows,
        runningIds: ids('#queue-running'), waitingIds: ids('#queue-waiting'), preemptedIds: ids('#preemption-log'),
        status: d('conn-status').status};
"""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, SERVER_ARGS, api_key=API_KEY) as remote:
        yield remote


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1300"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _complete(server: RemoteServer, prompt: list[int], max_tokens: int) -> dict:
    response = server.post("v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def _watch(browser, done: threading.Event, seen: list[dict], screenshot: str) -> None:
    """Sample the page every 0.1 s; one screenshot of it busy (requests running and waiting)."""
    while not done.is_set():
        seen.append(browser.execute_script(READ_PAGE))
        if screenshot and seen[-1]["waitingIds"] and len(seen[-1]["runningIds"]) >= 3:
            browser.save_screenshot(screenshot)
            screenshot = ""
        time.sleep(0.1)


def test_dashboard_shows_the_engine(server, browser, tmp_path):
    browser.get(server.url_for(f"dashboard?api_key={API_KEY}"))
    assert "api_key" not in browser.current_url  # dropped from the address bar
    assert wait_for(lambda: browser.execute_script(READ_PAGE)["status"] == "live", 20)
    # The first message is a snapshot of the idle engine: every usable block free.
    assert wait_for(lambda: browser.execute_script(READ_PAGE)["map"].get("numBlocks") == str(NUM_BLOCKS), 10)

    prefix = [11 + i for i in range(48)]  # three full blocks
    shared = [prefix + [300 + i, 400 + i] for i in range(2)]
    # Six requests, four seats (two wait, for a whole generation), each needing 15 blocks at
    # the end, 39 blocks for the four running (any three overlapping need more): preemptions.
    # A crowd lasts a second or two; on a loaded machine the page may draw none of it while a
    # request waits, so crowds are sent until it has (at most CROWDS; the timeline's 24 rows
    # still hold every request).
    crowd = [[500 + 7 * i + j for j in range(40)] for i in range(6)]
    done, seen = threading.Event(), []
    busy = tmp_path / "dashboard-busy.png"
    watcher = threading.Thread(target=_watch, args=(browser, done, seen, str(busy)))
    watcher.start()
    crowd_results: list[dict] = []
    try:
        with ThreadPoolExecutor(10) as pool:
            shared_results = list(pool.map(lambda p: _complete(server, p, 200), shared))
            for _ in range(CROWDS):
                crowd_results += pool.map(lambda p: _complete(server, p, 200), crowd)
                time.sleep(0.5)  # the page's next redraw
                if busy.exists():
                    break
    finally:
        done.set()
        watcher.join()

    # While the two prefix-sharing requests ran, their three common blocks were shared.
    assert max(int(s["map"].get("shared", 0)) for s in seen) >= 3
    # The block map agrees with the KV cache usage of the same message, at every sample.
    for s in seen:
        usable = int(s["map"]["numBlocks"]) - 1
        assert int(s["map"]["held"]) / usable == pytest.approx(s["kv"], abs=1e-9), s
    # Requests went through the queues.
    sent = [r["id"] for r in shared_results + crowd_results]
    queued = {i for s in seen for i in s["runningIds"] + s["waitingIds"]}
    # (The page redraws 4 times a second, so a request that lives less may never be drawn in a
    # queue; every one is in the timeline, checked below.)
    assert len(queued) >= len(crowd), (sent, queued)
    assert all(any(q.startswith(rid + "-") for rid in sent) for q in queued), (sent, queued)
    assert max(len(s["waitingIds"]) for s in seen) > 0 and busy.stat().st_size > 0, [
        (s["steps"], len(s["runningIds"]), len(s["waitingIds"]), s["status"]) for s in seen]

    # Idle: the page's counters are /metrics'.
    def settled() -> bool:
        page = browser.execute_script(READ_PAGE)
        return page["running"] == 0 and page["preemptions"] == server.metric("vllm:num_preemptions_total")
    assert wait_for(settled, 20)
    page = browser.execute_script(READ_PAGE)
    metrics = server.metrics()
    assert page["preemptions"] == metrics["vllm:num_preemptions_total"] > 0
    assert page["running"] == metrics["vllm:num_requests_running"] == 0
    assert page["waiting"] == metrics["vllm:num_requests_waiting"] == 0
    assert page["kv"] == pytest.approx(metrics["vllm:kv_cache_usage_perc"]) == 0
    assert int(page["map"]["held"]) == 0 and int(page["map"]["shared"]) == 0
    assert int(page["map"]["cached"]) > 0  # the finished prompts' full blocks stay cached
    # The timeline holds the latest requests, finished by length, each preemption counted.
    # (Engine-core ids: the response's id, the prompt's index, the registration: "cmpl-...-0-3".)
    rows = page["rows"]
    assert len(rows) == len(sent)
    for rid in sent:
        (row,) = [row for row in rows if row["id"].startswith(rid + "-")]
        assert row["status"] == "finished" and row["reason"] == "length"
    assert sum(row["preemptions"] for row in rows) == page["preemptions"]
    # Each preemption was logged as it happened.
    assert len(page["preemptedIds"]) == page["preemptions"]
    assert all(any(p.startswith(rid + "-") for rid in sent) for p in page["preemptedIds"])

    # Clicking a row shows that request: its prompt length, tokens and timings.
    target = shared_results[0]
    browser.execute_script(
        "document.querySelector(`#timeline-svg .tl-row[data-request-id^='${arguments[0]}-']`)"
        ".dispatchEvent(new MouseEvent('click', {bubbles: true}))", target["id"])
    fields = browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#details-list dd')]"
        ".map((dd) => [dd.dataset.field, dd.textContent]))")
    assert fields["prompt-length"] == str(target["usage"]["prompt_tokens"]) == "50"
    assert fields["tokens-so-far"].endswith(f"{target['usage']['completion_tokens']} generated")
    assert fields["finished"].endswith("(length)")
    browser.save_screenshot(str(tmp_path / "dashboard.png"))


def test_prompt_box_streams_a_chat_completion(server, browser):
    before = server.metric("vllm:request_success_total")
    browser.find_element("id", "prompt-max-tokens").clear()
    browser.find_element("id", "prompt-max-tokens").send_keys("12")
    browser.find_element("id", "prompt-send").click()
    output = browser.find_element("id", "prompt-output")
    assert wait_for(lambda: output.get_attribute("data-state") == "done", 30), output.text
    assert server.metric("vllm:request_success_total") == before + 1
    assert wait_for(lambda: any(r["id"].startswith("chatcmpl-") for r in browser.execute_script(READ_PAGE)["rows"]), 5)


def test_events_stream_starts_with_a_snapshot_and_needs_the_key(server, browser):
    browser.get("about:blank")  # the page and its stream go away
    with httpx.stream("GET", server.url_for("v1", "engine", "events"), headers=server.headers(),
                      timeout=10) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        first_data = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert '"block_map"' in first_data  # a newcomer's snapshot
    # The stream takes the key as a header only; the page as ?api_key= or a header.
    assert httpx.get(server.url_for("v1", "engine", "events"), timeout=10).status_code == 401
    assert httpx.get(server.url_for(f"v1/engine/events?api_key={API_KEY}"), timeout=10).status_code == 401
    assert httpx.get(server.url_for("dashboard"), timeout=10).status_code == 401
    assert httpx.get(server.url_for("dashboard?api_key=wrong"), timeout=10).status_code == 401
    assert server.get("dashboard").status_code == 200
    assert httpx.get(server.url_for("dashboard/static/dashboard.js"), timeout=10).status_code == 200  # code, no data
    assert httpx.get(server.url_for("dashboard/static/nothing.js"), timeout=10).status_code == 404


def test_shutdown_ends_open_event_streams(server):
    """SIGTERM while a stream is open (a dashboard left open): the stream ends and the server
    exits at once, not after --shutdown-timeout (30 s) of uvicorn waiting for the stream to end.
    (Last: it stops the module's server.)"""
    with httpx.Client(timeout=30) as client, client.stream(
            "GET", server.url_for("v1", "engine", "events"), headers=server.headers()) as response:
        assert next(response.iter_lines()) == ": connected"
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=25) == 0
        assert time.monotonic() - start < 10, server.output()[-3000:]
        print("LOG", server.output()[-1500:])
