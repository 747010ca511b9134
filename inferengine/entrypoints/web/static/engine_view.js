// The live engine view: /stats about once a second, as figures, small time series (inline SVG),
// a KV-page bar, and the replica and session tables.

import { api, errorMessage } from "./api.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const KEEP = 120; // points per series: two minutes
const RECENT = 10; // polls behind the "last 10 s" hit rate

const samples = []; // one per poll: {t, stats}

function stat(name, value) {
  const node = document.querySelector(`[data-stat="${name}"]`);
  if (node) node.textContent = value;
}

const int = (n) => (n ?? 0).toLocaleString("en-US");
const pct = (x) => (x === null || x === undefined || Number.isNaN(x) ? "–" : `${(100 * x).toFixed(1)}%`);
const rate = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));

function duration(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

/** Draw `series` (arrays of numbers, oldest first) as polylines in `svg`, on one scale. */
export function drawChart(svg, series, classes, fixedMax) {
  const [, , width, height] = svg.getAttribute("viewBox").split(" ").map(Number);
  const max = fixedMax ?? Math.max(1e-9, ...series.flat());
  const grid = document.createElementNS(SVG, "line");
  const baseline = { class: "grid", x1: 0, y1: height - 0.5, x2: width, y2: height - 0.5 };
  Object.entries(baseline).forEach(([name, value]) => grid.setAttribute(name, value));
  const nodes = [grid];
  series.forEach((values, k) => {
    const line = document.createElementNS(SVG, "polyline");
    const step = width / (KEEP - 1);
    const offset = (KEEP - values.length) * step;
    const points = values.map(
      (v, i) => `${(offset + i * step).toFixed(1)},${(height - 2 - (v / max) * (height - 6)).toFixed(1)}`,
    );
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", classes[k]);
    nodes.push(line);
  });
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "10");
  label.setAttribute("class", "chart-label");
  label.textContent = fixedMax ? "" : `max ${rate(max)}`;
  nodes.push(label);
  svg.replaceChildren(...nodes);
}

function kvBar(s) {
  const total = s.kv_pages_total || 0;
  const tiers = s.kv_tiers || {};
  const leased = Math.min(tiers.leased_blocks || 0, s.kv_pages_cached || 0);
  const parts = [
    ["used", s.kv_pages_used || 0],
    ["cached", Math.max(0, (s.kv_pages_cached || 0) - leased)],
    ["leased", leased],
  ];
  const free = Math.max(0, total - parts.reduce((sum, [, n]) => sum + n, 0));
  parts.push(["free", free]);
  const bar = $("kv-bar");
  bar.replaceChildren(
    ...parts.map(([name, n]) => {
      const span = document.createElement("span");
      span.className = name;
      span.style.width = total ? `${(100 * n) / total}%` : "0";
      span.title = `${name}: ${int(n)} pages`;
      return span;
    }),
  );
  bar.setAttribute("aria-label", parts.map(([name, n]) => `${name} ${n}`).join(", "));
}

function recentHitRate() {
  if (samples.length < 2) return null;
  const now = samples[samples.length - 1].stats;
  const then = samples[Math.max(0, samples.length - 1 - RECENT)].stats;
  const queries = now.prefix_cache_queries - then.prefix_cache_queries;
  return queries > 0 ? (now.prefix_cache_hits - then.prefix_cache_hits) / queries : null;
}

function table(node, columns, rows) {
  const head = document.createElement("tr");
  for (const [title] of columns) head.append(Object.assign(document.createElement("th"), { textContent: title }));
  const body = rows.map((row) => {
    const tr = document.createElement("tr");
    for (const [, value] of columns) {
      tr.append(Object.assign(document.createElement("td"), { textContent: value(row) }));
    }
    return tr;
  });
  const thead = document.createElement("thead");
  thead.append(head);
  const tbody = document.createElement("tbody");
  tbody.append(...body);
  node.replaceChildren(thead, tbody);
}

function replicas(s) {
  const card = $("replicas-card");
  card.hidden = !s.replicas;
  if (!s.replicas) return;
  table($("replicas"), [
    ["replica", (r) => r.id],
    ["status", (r) => r.status],
    ["running", (r) => int(r.num_requests_running)],
    ["waiting", (r) => int(r.num_requests_waiting)],
    ["in flight", (r) => int(r.requests_in_flight)],
    ["KV usage", (r) => pct(r.kv_cache_usage)],
    ["prefix hits", (r) => pct(r.prefix_cache_hit_rate)],
    ["served", (r) => int(r.requests_served)],
    ["restarts", (r) => int(r.restarts)],
  ], s.replicas);
}

function sessions(s) {
  const list = s.sessions || [];
  const live = s.kv_tiers ? s.kv_tiers.sessions : list.length;
  stat("sessions-count", live ? `(${int(live)} holding a lease)` : "");
  $("sessions-empty").hidden = list.length > 0;
  const columns = [
    ["prompt_cache_key", (x) => x.key],
    ["lease ends in", (x) => duration(x.expires_in_s)],
  ];
  if (list.some((x) => x.replica !== undefined)) columns.push(["replica", (x) => x.replica]);
  table($("sessions"), columns, list);
  $("sessions").hidden = list.length === 0;
}

function render(s) {
  const tiers = s.kv_tiers || {};
  const spec = s.spec_decoding;
  const replicaNote = s.data_parallel_size ? `, ${s.data_parallel_size} replicas` : "";
  $("engine-summary").textContent =
    `${s.model} on ${s.device}${replicaNote} · attention ${s.attention_backend} · ` +
    `up ${duration(s.uptime_s)} · engine pid ${s.engine_pid ?? "–"}`;
  stat("running", int(s.num_requests_running));
  stat("waiting", int(s.num_requests_waiting));
  stat("in-flight", int(s.num_requests_in_flight));
  stat("prompt-tps", rate(s.prompt_tokens_per_s || 0));
  stat("gen-tps", rate(s.generation_tokens_per_s || 0));
  stat("kv-used", `${int(s.kv_pages_used)} of ${int(s.kv_pages_total)} (${pct(s.kv_cache_usage)})`);
  stat("kv-cached", int(s.kv_pages_cached));
  stat("kv-leased", s.kv_tiers ? int(tiers.leased_blocks) : "–");
  stat(
    "cpu-tier",
    tiers.cpu_pages_total
      ? `${int(tiers.cpu_pages_used)} of ${int(tiers.cpu_pages_total)} pages, ${int(tiers.leased_cpu_pages)} leased`
      : "off",
  );
  stat("preemptions", int(s.num_preemptions));
  stat("hit-rate", s.prefix_cache_queries ? pct(s.prefix_cache_hit_rate) : "–");
  stat("hit-rate-recent", pct(recentHitRate()));
  stat("queries", int(s.prefix_cache_queries));
  stat("tier-hits", s.kv_tiers ? `${int(tiers.gpu_hit_tokens)} / ${int(tiers.cpu_hit_tokens)} tokens` : "–");
  stat("spec-acceptance", spec ? pct(spec.acceptance_rate) : "off");
  stat("spec-length", spec ? spec.mean_accepted_length.toFixed(2) : "–");
  stat("structured", int(s.num_structured_output_requests));
  kvBar(s);
  const series = (key) => samples.map((x) => x.stats[key] || 0);
  drawChart($("chart-requests"), [series("num_requests_running"), series("num_requests_waiting")], [
    "running",
    "waiting",
  ]);
  drawChart($("chart-tokens"), [series("prompt_tokens_per_s"), series("generation_tokens_per_s")], [
    "prompt",
    "gen",
  ]);
  drawChart($("chart-kv"), [series("kv_cache_usage")], ["used"], 1);
  replicas(s);
  sessions(s);
}

/** Poll /stats about once a second (not while the tab is hidden); `onStats(stats, error)`. */
export function setupEngineView(onStats) {
  const poll = async () => {
    if (!document.hidden) {
      try {
        const response = await api("/stats");
        if (!response.ok) throw new Error(await errorMessage(response));
        const stats = await response.json();
        samples.push({ t: Date.now(), stats });
        if (samples.length > KEEP) samples.shift();
        $("engine-error").hidden = true;
        render(stats);
        onStats(stats, null);
      } catch (error) {
        $("engine-error").textContent = `Could not read /stats: ${error.message}`;
        $("engine-error").hidden = false;
        onStats(null, error.message);
      }
    }
    setTimeout(poll, POLL_MS);
  };
  poll();
}
