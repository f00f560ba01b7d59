// The dashboard: polls /dashboard/state (built by api.py from cached state: the ranks are
// never woken by it), draws it, and streams chat answers from the OpenAI-compatible API.
// With API_KEY set both need the key (gateway/auth.py): the page asks for it once.
"use strict";

const POLL_MS = 2000;
const WINDOW_S = 600;
let apiKey = null; // asked once if the API wants one; kept in this page only
let keyDeclined = false; // the prompt was cancelled: the state poll does not ask again

function askKey() {
  apiKey = window.prompt("This server needs its API key:");
  keyDeclined = !apiKey;
  return !keyDeclined;
}

function withKey(headers = {}) {
  return apiKey ? { ...headers, Authorization: `Bearer ${apiKey}` } : headers;
}

const $ = (id) => document.getElementById(id);

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function count(n) {
  if (n == null) return "-";
  if (n >= 1e9) return `${(n / 1e9).toFixed(1)}B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(0)}M`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)}k`;
  return `${n}`;
}

function facts(element, pairs) {
  element.replaceChildren(...pairs.flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v ?? "-";
    return [dt, dd];
  }));
}

function duration(seconds) {
  if (seconds == null) return "";
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60);
  return h ? `up ${h} h ${m} min` : `up ${m} min ${Math.floor(seconds % 60)} s`;
}

function renderHeader(s) {
  const badge = $("state");
  badge.textContent = s.state;
  badge.className = `badge ${s.state}`;
  $("reason").textContent = s.reason;
  $("uptime").textContent = duration(s.uptime_s);
}

function renderModel(s) {
  const m = s.model;
  facts($("model"), [
    ["id", m.id], ["family", m.family], ["parameters", count(m.parameters)],
    ["weights", m.quantization], ["context", m.context_length && `${m.context_length} tokens`],
  ]);
}

function renderPlan(s) {
  const plan = s.plan || {};
  const shares = s.ranks.map((r) => r.share).filter(Boolean);
  $("plan-headline").textContent = plan.strategy
    ? `${plan.strategy} on ${plan.world_size} rank(s), asked ${plan.requested}` +
      (plan.note ? `; ${plan.note}` : "")
    : "no plan yet";
  $("plan-ranks").replaceChildren(...shares.map((line) => {
    const li = document.createElement("li");
    li.textContent = line.replace(/^rank \d+ /, "");
    return li;
  }));
}

function renderRanks(s) {
  const hosts = {};
  for (const r of s.ranks) hosts[r.host] = (hosts[r.host] || 0) + 1;
  $("ranks").replaceChildren(...s.ranks.map((r) => {
    const row = document.createElement("div");
    row.className = "rank-row";
    row.dataset.rank = r.rank;
    const budget = r.machine_memory_bytes / (hosts[r.host] || 1) || 1;
    const parts = [["weights", r.weight_bytes], ["kv", r.kv_bytes], ["cache", r.cache_bytes]];
    const bar = parts.map(([kind, n]) =>
      `<span class="${kind}" style="width:${Math.min(100, (100 * n) / budget)}%"></span>`).join("");
    row.innerHTML =
      `<div><span class="dot ${r.up ? "up" : ""}"></span><span class="rank-name">rank ${r.rank}</span></div>` +
      `<div><div class="bar">${bar}</div><div class="rank-detail"></div></div>`;
    row.querySelector(".rank-detail").textContent =
      `${r.host ?? "not reported"} · weights ${bytes(r.weight_bytes)} · KV ${bytes(r.kv_bytes)}` +
      ` · cache ${bytes(r.cache_bytes)} · of ${bytes(budget)}`;
    return row;
  }));
}

function renderLoading(s) {
  const section = $("loading-section");
  section.classList.toggle("hidden", s.state !== "loading" || !s.loading.length);
  $("loading").replaceChildren(...s.loading.map((p) => {
    const row = document.createElement("div");
    row.className = "rank-row";
    const share = p.total ? (100 * p.done) / p.total : 0;
    row.innerHTML = `<span class="rank-name">rank ${p.rank}</span>` +
      `<div><div class="progress"><span style="width:${share}%"></span></div>` +
      `<div class="rank-detail">${p.done} of ${p.total} layers</div></div>`;
    return row;
  }));
}

function renderTransfer(s) {
  // the model on its way to the workers before a start (launcher/transfer.py)
  const views = (s.supervisor && s.supervisor.transfer) || [];
  const active = views.some((v) => v.phase === "checking" || v.phase === "sending");
  $("transfer-section").classList.toggle("hidden", !active);
  $("transfer").replaceChildren(...views.map((v) => {
    const row = document.createElement("div");
    row.className = "rank-row";
    row.dataset.rank = v.rank;
    const share = v.total_bytes ? (100 * v.done_bytes) / v.total_bytes : 0;
    row.innerHTML = `<span class="rank-name">rank ${v.rank}</span>` +
      `<div><div class="progress"><span style="width:${share}%"></span></div>` +
      `<div class="rank-detail"></div></div>`;
    const left = v.eta_s == null ? "" : ` · ${Math.round(v.eta_s)} s left`;
    const rate = v.phase === "sending" ? ` · ${bytes(v.rate)}/s${left}` : "";
    row.querySelector(".rank-detail").textContent =
      `${v.host} · ${v.phase} · ${bytes(v.done_bytes)} of ${bytes(v.total_bytes)}${rate}` +
      (v.note ? ` · ${v.note}` : "");
    return row;
  }));
}

function plot(canvas, series, colors) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 24;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  // the last ten minutes, or since the first sample when the server is younger (>= 1 min)
  const first = series[0].length ? series[0][0][0] : now;
  const span = Math.min(WINDOW_S, Math.max(60, now - first));
  const max = Math.max(1, ...series.flatMap((points) => points.map((p) => p[1])));
  canvas.dataset.max = max.toFixed(2);
  canvas.dataset.points = series[0].length;
  ctx.strokeStyle = "#e2e5eb";
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui";
  for (const frac of [0, 0.5, 1]) {
    const y = h - pad - frac * (h - 2 * pad);
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText((frac * max).toFixed(max >= 10 ? 0 : 1), 0, y + 4);
  }
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i];
    ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach(([t, v], j) => {
      const x = pad + ((t - (now - span)) / span) * (w - pad);
      const y = h - pad - (v / max) * (h - 2 * pad);
      if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
}

function renderSeries(s) {
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const decode = s.series.map((p) => [p.t, p.decode_tps]);
  const prefill = s.series.map((p) => [p.t, p.prefill_tps]);
  plot($("tps-plot"), [decode, prefill], [color("--decode"), color("--prefill")]);
  const last = s.series[s.series.length - 1];
  $("tps-now").textContent = last
    ? `now ${last.decode_tps.toFixed(1)} decode, ${last.prefill_tps.toFixed(1)} prefill` : "";
  plot($("queue-plot"), [s.series.map((p) => [p.t, p.queued]),
    s.series.map((p) => [p.t, p.active])], [color("--queued"), color("--active")]);
}

function renderCache(s) {
  const c = s.prefix_cache;
  facts($("cache"), [
    ["state", c.enabled ? `on, ${count(c.budget_tokens)} tokens per rank` : "off"],
    ["hit rate", s.hit_rate == null ? "-" : `${(100 * s.hit_rate).toFixed(0)}% of recent prompt tokens`],
    ["hits / misses", `${c.hits} / ${c.misses}`],
    ["tokens reused", count(c.hit_tokens)],
    ["entries", `${c.entries} (${count(c.cached_tokens)} tokens, ${bytes(c.bytes)} on rank 0)`],
    ["evictions", c.evictions],
    ["on disk", `${c.disk_entries} (${count(c.disk_tokens)} tokens), ${c.disk_loads} read back`
      + (c.disk_load_failures ? `, ${c.disk_load_failures} refused` : "")],
  ]);
}

function renderSpeculation(s) {
  const p = s.speculation;
  facts($("speculation"), [
    ["state", p.enabled ? `prompt lookup${p.draft_model ? `, else draft ${p.draft_model}` : ""}, up to ${p.spec_tokens} tokens a row` : `off${p.reason ? `: ${p.reason}` : ""}`],
    ["proposed / accepted", `${count(p.proposed_tokens)} / ${count(p.accepted_tokens)}`],
    ["acceptance rate", p.proposed_tokens ? `${(100 * p.acceptance_rate).toFixed(0)}%` : "-"],
    ["tokens per step", p.tokens_per_step ? p.tokens_per_step.toFixed(2) : "-"],
  ]);
}

function renderSupervisor(s) {
  const sup = s.supervisor;
  const box = $("supervisor");
  if (!sup) { box.textContent = "no supervisor reports"; return; }
  const lines = [sup.summary];
  for (const r of (sup.history || []).slice(-8).reverse()) {
    lines.push(`${new Date(r.at * 1000).toLocaleTimeString()} ${r.what}: ${r.reason}`);
  }
  box.textContent = lines.join("\n");
  box.style.whiteSpace = "pre-wrap";
}

function renderRecent(s) {
  $("recent").tBodies[0].replaceChildren(...s.recent.map((r) => {
    const tr = document.createElement("tr");
    const cells = [new Date(r.finished_at * 1000).toLocaleTimeString(), r.prompt_tokens,
      r.cached_tokens, r.completion_tokens, `${r.ttft_s.toFixed(3)} s`,
      r.tokens_per_second.toFixed(1), r.finish_reason];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    return tr;
  }));
}

async function refresh() {
  try {
    const state = () => fetch("/dashboard/state", { cache: "no-store", headers: withKey() });
    let response = await state();
    if (response.status === 401 && !keyDeclined && askKey()) response = await state();
    if (!response.ok) throw new Error(`/dashboard/state: HTTP ${response.status}`);
    const s = await response.json();
    renderHeader(s); renderModel(s); renderPlan(s); renderRanks(s); renderLoading(s);
    renderTransfer(s);
    renderSeries(s); renderCache(s); renderSpeculation(s); renderSupervisor(s); renderRecent(s);
  } catch (error) {
    $("state").textContent = "api down";
    $("state").className = "badge down";
    $("reason").textContent = `${error}`;
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

// ---- chat ------------------------------------------------------------------------------

const history = [];

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

async function send(messages) {
  const headers = withKey({ "Content-Type": "application/json" });
  return fetch("/v1/chat/completions", {
    method: "POST", headers,
    body: JSON.stringify({ model: "default", messages, max_tokens: 256, stream: true }),
  });
}

async function chat(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  let response = await send(history);
  if (response.status === 401 && askKey()) response = await send(history);
  const out = addMessage("assistant", "");
  document.getElementById("chat-output")?.removeAttribute("id");
  out.id = "chat-output";
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    out.className = "msg error";
    out.textContent = body.error?.message || `HTTP ${response.status}`;
    history.pop();
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "", answer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "").trim();
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) { out.className = "msg error"; out.textContent = chunk.error.message; return; }
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        answer += delta;
        out.textContent = answer;
        out.dataset.chunks = `${Number(out.dataset.chunks || 0) + 1}`;
      }
    }
  }
  history.push({ role: "assistant", content: answer });
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  $("chat-send").disabled = true;
  try { await chat(text); } finally { $("chat-send").disabled = false; }
});

$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

refresh();
