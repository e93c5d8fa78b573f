// The minivllm dashboard: reads /v1/engine/events (one SSE message per engine step: the step's
// EngineEvents, see minivllm/core/events.py, and the scheduler stats /metrics reports), keeps
// the engine's state here, and redraws four times a second. Plain JS, SVG and a canvas: no
// build step, nothing from the network.
"use strict";

// ---- authentication: ?api_key=KEY is kept in memory, dropped from the address bar, and sent
// as a header (fetch can, EventSource could not).
const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
if (apiKey !== null) history.replaceState(null, "", location.pathname);
const authHeaders = () => (apiKey ? { Authorization: `Bearer ${apiKey}` } : {});

const WINDOW_S = 60; // timeline
const CHART_S = 300; // charts
const MAX_ROWS = 24; // timeline rows (latest requests)
const MAX_REQUESTS = 400; // finished requests kept
const MAX_STEPS = 120; // budget chart

const S = {
  requests: new Map(), // id -> request state (see req())
  blocks: [], // block_code per block: 2 * holders + hashed
  running: [], waiting: [],
  steps: [], preemptions: [], samples: [], finishedMetrics: [],
  stats: null, stepsSeen: 0, dropped: 0,
  engineNow: 0, receivedAt: 0, // engine clock (monotonic s) at the last message, and when it came
  selected: null,
};

function req(id) {
  let r = S.requests.get(id);
  if (!r) {
    r = { id, promptLen: null, arrival: null, computed: 0, outputLen: 0, blocks: [], status: "waiting",
          spans: [], open: null, firstToken: null, finish: null, preemptions: 0, chunks: 0 };
    S.requests.set(id, r);
  }
  return r;
}

function closeOpen(r, at) {
  if (r.open) { r.spans.push({ kind: r.open.kind, start: r.open.start, end: at }); r.open = null; }
}

function applyMessage(msg) {
  const ev = msg.events;
  S.stats = msg.stats;
  S.engineNow = Math.max(S.engineNow, ev.end);
  S.receivedAt = performance.now();
  if (ev.requests) applySnapshot(ev);
  for (const a of ev.arrived || []) {
    const r = req(a.id);
    r.promptLen = a.prompt_len; r.arrival = a.arrival;
    if (!r.open && !r.spans.length) r.open = { kind: "waiting", start: a.arrival };
  }
  for (const c of ev.scheduled || []) {
    const r = req(c.id);
    closeOpen(r, ev.start);
    r.status = "running"; r.computed = c.computed; r.outputLen = c.output_len;
    const last = r.spans[r.spans.length - 1];
    if (c.prefill) { r.spans.push({ kind: "prefill", start: ev.start, end: ev.end, tokens: c.tokens }); r.chunks++; }
    else if (last && last.kind === "decode") last.end = ev.end;
    else r.spans.push({ kind: "decode", start: ev.start, end: ev.end });
  }
  for (const id of ev.first_token || []) req(id).firstToken = ev.end;
  for (const id of ev.preempted || []) {
    const r = req(id);
    r.preemptions++; r.status = "preempted"; r.blocks = []; r.open = { kind: "preempted", start: ev.start };
    S.preemptions.push({ time: ev.start, id });
  }
  for (const [id, blocks] of Object.entries(ev.block_tables || {})) req(id).blocks = blocks;
  for (const f of ev.finished || []) {
    const r = req(f.id);
    closeOpen(r, ev.end);
    r.status = "finished"; r.blocks = []; r.outputLen = f.output_len;
    r.finish = { time: ev.end, reason: f.reason };
    if (r.firstToken !== null && r.arrival !== null) {
      S.finishedMetrics.push({ time: ev.end, ttft: r.firstToken - r.arrival,
                               tpot: r.outputLen > 1 ? (ev.end - r.firstToken) / (r.outputLen - 1) : null });
    }
  }
  if (ev.block_map) S.blocks = ev.block_map.slice();
  const changes = ev.block_changes || [];
  for (let i = 0; i < changes.length; i += 2) S.blocks[changes[i]] = changes[i + 1];
  S.running = ev.running || []; S.waiting = ev.waiting || [];
  if (ev.step >= 0) {
    S.stepsSeen++;
    const generated = (ev.scheduled || []).filter((c) => !c.prefill).reduce((n, c) => n + c.tokens, 0)
      + (ev.first_token || []).length;
    S.steps.push({ prefill: ev.num_prefill_tokens || 0, decode: ev.num_decode_tokens || 0, budget: ev.token_budget,
                   preempted: (ev.preempted || []).length });
    if (S.steps.length > MAX_STEPS) S.steps.shift();
    S.samples.push({ time: ev.end, tokens: generated });
  }
  prune();
}

function applySnapshot(ev) {
  // Every live request, as the engine has it now: requests missing from it are over (their end
  // was in messages this page lost).
  const live = new Set();
  for (const info of ev.requests) {
    live.add(info.id);
    const r = req(info.id);
    Object.assign(r, { promptLen: info.prompt_len, arrival: info.arrival, computed: info.computed,
                       outputLen: info.output_len, blocks: info.blocks, status: info.status });
    if (!r.open && !r.spans.length && info.status !== "running") r.open = { kind: "waiting", start: info.arrival };
  }
  for (const r of S.requests.values()) {
    if (!live.has(r.id) && r.status !== "finished") { closeOpen(r, ev.end); r.status = "finished"; r.blocks = []; r.finish = { time: ev.end, reason: "?" }; }
  }
}

function prune() {
  const horizon = S.engineNow - CHART_S;
  while (S.samples.length && S.samples[0].time < horizon) S.samples.shift();
  while (S.finishedMetrics.length && S.finishedMetrics[0].time < horizon) S.finishedMetrics.shift();
  while (S.preemptions.length > 50) S.preemptions.shift();
  const finished = [...S.requests.values()].filter((r) => r.status === "finished");
  for (const r of finished.slice(0, Math.max(0, finished.length - MAX_REQUESTS))) S.requests.delete(r.id);
}

// ---- the event stream -------------------------------------------------------------------

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function setStatus(text, status) {
  const el = document.getElementById("conn-status");
  el.textContent = text; el.dataset.status = status;
}

// Server-sent events: each frame (the text between blank lines) to onFrame, until the stream ends.
async function readFrames(response, onFrame) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      onFrame(frame);
    }
  }
}

function handleFrame(frame) {
  let event = "message", data = "";
  for (const line of frame.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  if (event === "dropped") S.dropped = Number(data);
  else applyMessage(JSON.parse(data));
}

async function connect() {
  for (;;) {
    try {
      const response = await fetch("/v1/engine/events", { headers: authHeaders() });
      if (!response.ok) {
        setStatus(`events: HTTP ${response.status} ${(await response.text()).slice(0, 120)}`, "error");
        await sleep(3000);
        continue;
      }
      setStatus("live", "live");
      await readFrames(response, handleFrame);
    } catch (e) {
      console.warn(e);
    }
    setStatus("disconnected: retrying", "error");
    await sleep(1000);
  }
}

// ---- drawing ----------------------------------------------------------------------------

const SVG_NS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}
const COLORS = { waiting: "#cfd8dc", prefill: "#fb8c00", decode: "#1e88e5", preempted: "#e53935" };
function requestColor(id) {
  let h = 0;
  for (const ch of id) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${(h * 47) % 360}, 60%, 55%)`;
}
const shortId = (id) => (id.length > 22 ? `${id.slice(0, 10)}…${id.slice(-8)}` : id);
const fmt = (x, digits = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits));

function setStat(id, value, text) {
  const el = document.getElementById(id);
  el.dataset.value = String(value);
  el.textContent = text;
}

function renderStats() {
  const s = S.stats;
  if (!s) return;
  setStat("stat-running", s.num_running_reqs, String(s.num_running_reqs));
  setStat("stat-waiting", s.num_waiting_reqs, String(s.num_waiting_reqs));
  setStat("stat-preemptions", s.num_preemptions, String(s.num_preemptions));
  setStat("stat-kv-usage", s.kv_cache_usage, `${(100 * s.kv_cache_usage).toFixed(1)}%`);
  const hitRate = s.prefix_cache_queries ? s.prefix_cache_hits / s.prefix_cache_queries : 0;
  setStat("stat-prefix-hit-rate", hitRate, `${(100 * hitRate).toFixed(1)}%`);
  setStat("stat-steps", S.stepsSeen, String(S.stepsSeen));
  setStat("stat-dropped", S.dropped, String(S.dropped));
}

function renderQueue(elementId, ids, countId) {
  const list = document.getElementById(elementId);
  document.getElementById(countId).textContent = String(ids.length);
  list.replaceChildren(...ids.slice(0, 100).map((id) => {
    const r = req(id);
    const li = document.createElement("li");
    li.dataset.requestId = id;
    li.style.setProperty("--c", requestColor(id));
    li.title = id;
    li.textContent = `${shortId(id)}  ${r.computed}/${(r.promptLen ?? 0) + r.outputLen} tok  ${r.blocks.length} blk` +
      (r.preemptions ? `  preempted ×${r.preemptions}` : "");
    if (id === S.selected) li.classList.add("selected");
    return li;
  }));
}

function renderBudget() {
  const svg = document.getElementById("budget-chart");
  svg.replaceChildren();
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const bar = w / MAX_STEPS;
  // Scaled to the busiest step shown; the budget line when it is in range.
  const top = Math.max(1, ...S.steps.map((s) => s.prefill + s.decode));
  const budget = S.steps.length ? S.steps[S.steps.length - 1].budget : 0;
  const full = budget <= 1.25 * top ? budget : top;
  const scale = (h - 12) / Math.max(full, 1);
  S.steps.forEach((step, i) => {
    const x = i * bar;
    const decodeH = step.decode * scale, prefillH = step.prefill * scale;
    svgEl("rect", { x, y: h - decodeH, width: bar * 0.9, height: decodeH, fill: COLORS.decode }, svg);
    svgEl("rect", { x, y: h - decodeH - prefillH, width: bar * 0.9, height: prefillH, fill: COLORS.prefill }, svg);
    if (step.preempted) svgEl("rect", { x, y: 0, width: bar * 0.9, height: 6, fill: COLORS.preempted }, svg);
  });
  if (full === budget) svgEl("line", { x1: 0, x2: w, y1: 12, y2: 12, stroke: "#999", "stroke-dasharray": "3 3" }, svg);
  svgEl("text", { x: w - 4, y: 10, "text-anchor": "end" }, svg).textContent =
    full === budget ? `budget ${budget}` : `max ${top} tokens (budget ${budget})`;
  const last = S.steps[S.steps.length - 1];
  const note = document.getElementById("budget-last");
  if (last) {
    note.textContent = `last step: ${last.prefill} prefill-chunk + ${last.decode} decode tokens of a ${last.budget}-token budget`;
    Object.assign(note.dataset, { prefill: last.prefill, decode: last.decode, budget: last.budget });
  }
  const log = document.getElementById("preemption-log");
  log.replaceChildren(...S.preemptions.slice().reverse().map((p) => {
    const li = document.createElement("li");
    li.dataset.requestId = p.id;
    li.style.setProperty("--c", COLORS.preempted);
    li.textContent = `${fmt(S.engineNow - p.time, 1)} s ago: ${p.id}`;
    return li;
  }));
}

// Block map: one cell per block, coloured by state, held blocks by their (first) holder;
// shared blocks outlined with their holder count.
const BLOCK_COLORS = { null: "#263238", free: "#eceff1", cached: "#a5d6a7" };
let cellSize = 8, columns = 1;

function blockHolders() {
  const holders = new Map();
  for (const r of S.requests.values()) {
    if (r.status !== "running") continue;
    for (const b of r.blocks) {
      if (!holders.has(b)) holders.set(b, []);
      holders.get(b).push(r.id);
    }
  }
  return holders;
}

function blockState(code, id) {
  if (id === 0) return "null";
  if (code === 0) return "free";
  if (code === 1) return "cached";
  return code >= 4 ? "shared" : "held";
}

function renderBlocks() {
  const canvas = document.getElementById("block-map");
  const ctx = canvas.getContext("2d");
  const n = S.blocks.length;
  cellSize = Math.max(3, Math.min(36, Math.floor(Math.sqrt((canvas.width * 300) / Math.max(n, 1)))));
  columns = Math.max(1, Math.floor(canvas.width / cellSize));
  const height = Math.max(cellSize, Math.ceil(n / columns) * cellSize);
  if (canvas.height !== height) canvas.height = height;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const holders = blockHolders();
  const counts = { free: 0, cached: 0, held: 0, shared: 0 };
  for (let id = 0; id < n; id++) {
    const code = S.blocks[id], state = blockState(code, id);
    const x = (id % columns) * cellSize, y = Math.floor(id / columns) * cellSize;
    if (state !== "null") counts[state === "shared" ? "held" : state]++;
    if (state === "shared") counts.shared++;
    const owners = holders.get(id);
    ctx.fillStyle = BLOCK_COLORS[state] || (owners ? requestColor(owners[0]) : "#7e57c2");
    ctx.fillRect(x + 0.5, y + 0.5, cellSize - 1, cellSize - 1);
    if (state === "shared") {
      ctx.strokeStyle = "#000"; ctx.lineWidth = 2;
      ctx.strokeRect(x + 1.5, y + 1.5, cellSize - 3, cellSize - 3);
      if (cellSize >= 12) {
        ctx.fillStyle = "#fff"; ctx.font = `${Math.min(14, cellSize / 2)}px monospace`;
        ctx.fillText(String(code >> 1), x + 4, y + cellSize - 4);
      }
    }
    if (S.selected && owners && owners.includes(S.selected)) {
      ctx.strokeStyle = "#ffeb3b"; ctx.lineWidth = 2; ctx.strokeRect(x + 1, y + 1, cellSize - 2, cellSize - 2);
    }
  }
  for (const [k, v] of Object.entries(counts)) document.getElementById(`kv-${k}`).textContent = String(v);
  Object.assign(canvas.dataset, { numBlocks: n, free: counts.free, cached: counts.cached, held: counts.held,
                                  shared: counts.shared });
}

function blockAt(event) {
  const canvas = event.target, rect = canvas.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / cellSize), row = Math.floor((event.clientY - rect.top) / cellSize);
  const id = row * columns + col;
  return col < columns && id < S.blocks.length ? id : null;
}

function renderTimeline() {
  const svg = document.getElementById("timeline-svg");
  svg.replaceChildren();
  const w = +svg.getAttribute("width"), labelW = 150, rowH = 14;
  const now = S.engineNow + (S.receivedAt ? Math.min((performance.now() - S.receivedAt) / 1000, 5) : 0);
  const rows = [...S.requests.values()].filter((r) => r.arrival !== null && (r.finish === null || r.finish.time > now - WINDOW_S))
    .sort((a, b) => a.arrival - b.arrival).slice(-MAX_ROWS);
  // The window: what the rows span, between 5 s and WINDOW_S.
  const span = Math.min(WINDOW_S, Math.max(5, rows.length ? (now - rows[0].arrival) * 1.05 : 0));
  const t0 = now - span;
  const x = (t) => labelW + Math.max(0, (t - t0) / span) * (w - labelW - 10);
  svg.setAttribute("height", String(Math.max(40, rows.length * rowH + 20)));
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    const g = svgEl("g", { class: "tl-row" + (r.id === S.selected ? " selected" : ""), "data-request-id": r.id,
                           "data-status": r.status, "data-finish-reason": r.finish ? r.finish.reason : "",
                           "data-preemptions": r.preemptions, "data-prefill-chunks": r.chunks }, svg);
    svgEl("rect", { class: "bg", x: 0, y, width: w, height: rowH, fill: "transparent" }, g);
    svgEl("text", { x: 2, y: y + 10 }, g).textContent = shortId(r.id);
    svgEl("title", {}, g).textContent = `${r.id}: ${r.status}, prompt ${r.promptLen} tokens, ${r.outputLen} generated`;
    const spans = r.open ? [...r.spans, { kind: r.open.kind, start: r.open.start, end: now }] : r.spans;
    for (const span of spans) {
      if (span.end < t0) continue;
      svgEl("rect", { x: x(span.start), y: y + 2, width: Math.max(1, x(span.end) - x(span.start)), height: rowH - 4,
                      fill: COLORS[span.kind], "data-kind": span.kind }, g);
    }
    if (r.status === "running" && !r.open) {
      const last = r.spans[r.spans.length - 1];
      if (last) svgEl("rect", { x: x(last.end), y: y + 5, width: Math.max(0, x(now) - x(last.end)), height: rowH - 10,
                                fill: COLORS.decode, opacity: 0.4 }, g);
    }
    if (r.firstToken !== null && r.firstToken > t0) {
      svgEl("line", { x1: x(r.firstToken), x2: x(r.firstToken), y1: y, y2: y + rowH, stroke: "#000", "stroke-width": 2 }, g);
    }
    if (r.finish) {
      const fx = x(r.finish.time);
      svgEl("path", { d: `M${fx},${y + 1} l5,6 l-5,6 l-5,-6 z`, fill: "#000" }, g);
      svgEl("text", { x: fx + 7, y: y + 10 }, g).textContent = r.finish.reason;
    }
  });
  svgEl("text", { x: labelW, y: +svg.getAttribute("height") - 3 }, svg).textContent = `-${fmt(span, 1)} s`;
  svgEl("text", { x: w - 30, y: +svg.getAttribute("height") - 3 }, svg).textContent = "now";
}

function lineChart(svgId, points, label) {
  const svg = document.getElementById(svgId);
  svg.replaceChildren();
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const values = points.map((p) => p.y).filter((v) => v !== null);
  const max = Math.max(...values, 1e-9);
  svg.dataset.points = String(values.length);
  const x = (t) => ((t - (S.engineNow - CHART_S)) / CHART_S) * (w - 4) + 2;
  const y = (v) => h - 4 - (v / max) * (h - 18);
  const drawn = points.filter((p) => p.y !== null);
  if (label === "line") {
    svgEl("polyline", { points: drawn.map((p) => `${x(p.t)},${y(p.y)}`).join(" "), fill: "none", stroke: COLORS.decode,
                        "stroke-width": 1.5 }, svg);
  } else {
    for (const p of drawn) svgEl("circle", { cx: x(p.t), cy: y(p.y), r: 2.5, fill: COLORS.prefill }, svg);
  }
  svgEl("text", { x: 4, y: 11 }, svg).textContent = `max ${fmt(max, 3)}`;
}

function renderCharts() {
  // Generated tokens per second, in 5 s buckets.
  const bucket = 5, buckets = new Map();
  for (const s of S.samples) {
    const k = Math.floor(s.time / bucket);
    buckets.set(k, (buckets.get(k) || 0) + s.tokens);
  }
  const points = [...buckets.entries()].sort((a, b) => a[0] - b[0]).map(([k, n]) => ({ t: (k + 0.5) * bucket, y: n / bucket }));
  lineChart("chart-throughput", points, "line");
  const recent = S.samples.filter((s) => s.time > S.engineNow - bucket).reduce((n, s) => n + s.tokens, 0) / bucket;
  document.getElementById("throughput-now").textContent = `now ${fmt(recent, 1)}`;
  lineChart("chart-ttft", S.finishedMetrics.map((m) => ({ t: m.time, y: m.ttft })), "dots");
  lineChart("chart-tpot", S.finishedMetrics.map((m) => ({ t: m.time, y: m.tpot })), "dots");
}

function renderDetails() {
  const panel = document.getElementById("details");
  const list = document.getElementById("details-list");
  const r = S.selected ? S.requests.get(S.selected) : null;
  panel.dataset.requestId = r ? r.id : "";
  if (!r) { list.replaceChildren(); return; }
  const rel = (t) => (t === null || t === undefined || r.arrival === null ? "-" : `+${fmt(t - r.arrival)} s`);
  const rows = [
    ["id", r.id], ["status", r.status], ["prompt length", r.promptLen ?? "-"],
    ["tokens so far", `${r.computed} computed, ${r.outputLen} generated`],
    ["blocks", `${r.blocks.length}: [${r.blocks.join(", ")}]`], ["prefill chunks", r.chunks],
    ["preemptions", r.preemptions], ["first token", rel(r.firstToken)],
    ["time to first token", r.firstToken !== null && r.arrival !== null ? `${fmt(r.firstToken - r.arrival)} s` : "-"],
    ["finished", r.finish ? `${rel(r.finish.time)} (${r.finish.reason})` : "-"],
  ];
  list.replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k; dd.textContent = String(v);
    dd.dataset.field = k.replaceAll(" ", "-");
    return [dt, dd];
  }));
}

function render() {
  renderStats();
  renderQueue("queue-running", S.running, "running-count");
  renderQueue("queue-waiting", S.waiting, "waiting-count");
  renderBudget();
  renderBlocks();
  renderTimeline();
  renderCharts();
  renderDetails();
}

// ---- interaction ------------------------------------------------------------------------

function select(id) { S.selected = id; renderDetails(); }

document.addEventListener("mouseover", (event) => {
  const el = event.target.closest("[data-request-id]");
  if (el && el.id !== "details" && el.dataset.requestId) select(el.dataset.requestId);
});
document.addEventListener("click", (event) => {
  const el = event.target.closest("[data-request-id]");
  if (el && el.id !== "details" && el.dataset.requestId) select(el.dataset.requestId);
});
const blockMap = document.getElementById("block-map");
blockMap.addEventListener("mousemove", (event) => {
  const id = blockAt(event);
  if (id === null) return;
  const code = S.blocks[id], owners = blockHolders().get(id) || [];
  document.getElementById("block-info").textContent =
    `block ${id}: ${blockState(code, id)}, ${code >> 1} holder(s)${code & 1 ? ", prefix-cached" : ""}` +
    (owners.length ? `: ${owners.join(", ")}` : "");
});
blockMap.addEventListener("click", (event) => {
  const id = blockAt(event);
  const owners = id === null ? [] : blockHolders().get(id) || [];
  if (owners.length) select(owners[0]);
});

// The prompt box: a streaming chat completion through the same API as every client.
async function sendPrompt() {
  const output = document.getElementById("prompt-output");
  output.textContent = "";
  output.dataset.state = "streaming";
  const models = await (await fetch("/v1/models", { headers: authHeaders() })).json();
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify({ model: models.data[0].id, stream: true,
                           max_tokens: Number(document.getElementById("prompt-max-tokens").value),
                           messages: [{ role: "user", content: document.getElementById("prompt-input").value }] }),
  });
  if (!response.ok) { output.textContent = await response.text(); output.dataset.state = "error"; return; }
  await readFrames(response, (frame) => {
    const line = frame.replace(/^data: /, "");
    if (line === "[DONE]") return;
    const delta = JSON.parse(line).choices[0]?.delta?.content;
    if (delta) output.textContent += delta;
  });
  output.dataset.state = "done";
}
document.getElementById("prompt-send").addEventListener("click", () => sendPrompt().catch((e) => {
  const output = document.getElementById("prompt-output");
  output.textContent = String(e); output.dataset.state = "error";
}));

fetch("/v1/models", { headers: authHeaders() }).then((r) => r.json())
  .then((m) => { document.getElementById("model-name").textContent = m.data.map((d) => d.id).join(", "); })
  .catch(() => {});
setInterval(render, 250);
connect();
