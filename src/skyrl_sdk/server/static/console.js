// skyrl-sdk console: reads /console/api/* with the key kept in this tab's sessionStorage and
// draws runs, curves (plain SVG) and checkpoints. Every value from the server is put in the
// page as text (textContent / attributes), never parsed as HTML.
"use strict";

const KEY_ITEM = "skyrl-console-key";
const RUN_ITEM = "skyrl-console-run";
const POLL_MS = 2000;
const PAGE = 50;
const CHECKPOINTS_SHOWN = 10;  // the newest; a button shows the rest
const SVG = "http://www.w3.org/2000/svg";
const CHARTS = [
  ["loss_per_token", "loss per token"], ["loss_sum", "loss:sum"], ["grad_norm", "grad_norm"],
  ["learning_rate", "learning rate"], ["skipped", "skipped steps"], ["tokens", "tokens per step"],
  ["seconds", "seconds per step"],
];

const state = { me: null, offset: 0, selected: null, curvesSig: null, busy: false, timer: null, allCheckpoints: false };

class AuthError extends Error {}

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c === null ? "" : String(c)));
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

// ---- the key --------------------------------------------------------------------------------
function takeFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("key")) sessionStorage.setItem(KEY_ITEM, params.get("key"));
  if (params.get("run")) sessionStorage.setItem(RUN_ITEM, params.get("run"));
  if (location.hash) history.replaceState(null, "", location.pathname + location.search);
}

async function api(path) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers["X-API-Key"] = key;
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) throw new AuthError("this server needs a known API key");
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(`${path}: ${r.status} ${detail}`);
  }
  return r.json();
}

function showLogin(message) {
  clearInterval(state.timer);
  state.me = null;
  $("app").hidden = true;
  $("forget").hidden = true;
  $("who").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("key-input").focus();
}

async function start() {
  try {
    state.me = await api("/console/api/me");
  } catch (e) {
    if (e instanceof AuthError) {
      const had = sessionStorage.getItem(KEY_ITEM);
      sessionStorage.removeItem(KEY_ITEM);
      showLogin(had ? "This key is not known to this server." : "");
      return;
    }
    $("error").textContent = String(e.message || e);
    return;
  }
  $("login").hidden = true;
  $("app").hidden = false;
  $("forget").hidden = !state.me.key_required;
  $("who").textContent = `owner ${state.me.owner}${state.me.operator ? " (operator)" : ""} · skyrl-sdk ${state.me.version}`;
  $("server-panel").hidden = !state.me.operator;
  state.selected = sessionStorage.getItem(RUN_ITEM);
  await tick();
  state.timer = setInterval(() => { if (!document.hidden) tick(); }, POLL_MS);
}

// ---- formatting -----------------------------------------------------------------------------
function fmtTime(iso) { return iso ? new Date(iso).toLocaleString() : ""; }

function fmtAgo(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return fmtTime(iso);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function fmtNum(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return String(Number(v.toPrecision(4)));
}

// ---- polling --------------------------------------------------------------------------------
async function tick() {
  if (state.busy) return;
  state.busy = true;
  try {
    await refreshRuns();
    if (state.selected) await refreshRun();
    if (state.me && state.me.operator) renderServer(await api("/console/api/server"));
    $("error").textContent = "";
    $("refresh-state").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (e instanceof AuthError) { showLogin("The key is no longer accepted."); return; }
    $("error").textContent = String(e.message || e);
  } finally {
    state.busy = false;
  }
}

async function refreshRuns() {
  const page = await api(`/console/api/runs?limit=${PAGE}&offset=${state.offset}`);
  $("runs-total").textContent = `(${page.total})`;
  $("runs-empty").hidden = page.total > 0;
  $("page").textContent = page.total ? `${page.offset + 1}-${page.offset + page.runs.length} of ${page.total}` : "";
  $("prev").disabled = page.offset === 0;
  $("next").disabled = page.offset + page.runs.length >= page.total;
  if (!state.selected && page.runs.length) state.selected = page.runs[0].model_id;
  const body = $("runs").tBodies[0];
  body.replaceChildren(...page.runs.map((r) => {
    const row = el("tr", { "data-run-id": r.model_id, class: r.model_id === state.selected ? "selected" : null },
      el("td", { class: "id" }, r.model_id), el("td", {}, r.base_model),
      el("td", {}, r.lora_rank === null ? "full" : `rank ${r.lora_rank}`), el("td", {}, fmtTime(r.created)),
      el("td", { title: fmtTime(r.last_request) }, fmtAgo(r.last_request)), el("td", { class: "num" }, r.steps),
      el("td", { class: "num" }, r.last ? fmtNum(r.last.loss_per_token) : ""),
      el("td", {}, el("span", { class: `status ${r.status}` }, r.status)),
      el("td", { class: "num" }, r.sampling_sessions));
    row.addEventListener("click", () => select(r.model_id));
    return row;
  }));
}

async function select(runId) {
  state.selected = runId;
  state.curvesSig = null;
  state.allCheckpoints = false;
  sessionStorage.setItem(RUN_ITEM, runId);
  for (const row of $("runs").tBodies[0].rows) row.classList.toggle("selected", row.dataset.runId === runId);
  try { await refreshRun(); } catch (e) { $("error").textContent = String(e.message || e); }
}

async function refreshRun() {
  let run;
  try {
    run = await api(`/console/api/runs/${encodeURIComponent(state.selected)}`);
  } catch (e) {
    if (e instanceof AuthError) throw e;
    sessionStorage.removeItem(RUN_ITEM);  // not (or no longer) this owner's run
    state.selected = null;
    $("run-panel").hidden = true;
    return;
  }
  renderRun(run);
  const sig = `${run.model_id}|${run.steps}`;
  if (sig !== state.curvesSig) {
    const curves = await api(`/console/api/runs/${encodeURIComponent(run.model_id)}/curves?points=1000`);
    renderCurves(curves);
    state.curvesSig = sig;
  }
}

// ---- one run ----------------------------------------------------------------------------------
function renderRun(run) {
  $("run-panel").hidden = false;
  $("run-panel").dataset.runId = run.model_id;
  $("run-title").textContent = run.model_id;
  const info = [["base model", run.base_model], ["LoRA", run.lora_rank === null ? "full fine-tuning" : `rank ${run.lora_rank}`],
    ["status", run.status], ["steps", run.steps], ["created", fmtTime(run.created)],
    ["last request", `${fmtTime(run.last_request)} (${fmtAgo(run.last_request)})`], ["session", run.session_id],
    ["sampling sessions", run.sampling_sessions]];
  $("run-info").replaceChildren(...info.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const body = $("checkpoints").tBodies[0];
  $("checkpoints-empty").hidden = run.checkpoints.length > 0;
  const newest = run.checkpoints.slice().reverse();
  const shown = state.allCheckpoints ? newest : newest.slice(0, CHECKPOINTS_SHOWN);
  $("checkpoints-more").hidden = shown.length === newest.length;
  $("checkpoints-more").textContent = `show all ${newest.length}`;
  body.replaceChildren(...shown.map((c) => {
    const copy = el("button", { type: "button", class: "copy", title: "copy the path" }, "copy");
    copy.addEventListener("click", () => copyText(c.tinker_path, copy));
    return el("tr", { "data-path": c.tinker_path }, el("td", {}, c.checkpoint_id.split("/").slice(1).join("/")),
      el("td", {}, c.checkpoint_type === "sampler" ? "sampler weights" : "training state"),
      el("td", { class: "path" }, el("code", {}, c.tinker_path), " ", copy), el("td", { class: "num" }, fmtBytes(c.size_bytes)),
      el("td", {}, fmtTime(c.time)));
  }));
}

function copyText(text, button) {
  const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text, done));
  } else {
    fallbackCopy(text, done);
  }
}

function fallbackCopy(text, done) {  // plain http to another host: no clipboard API
  const area = el("textarea", { readonly: "" }, text);
  document.body.append(area);
  area.select();
  try { if (document.execCommand("copy")) done(); } finally { area.remove(); }
}

function renderCurves(curves) {
  const wide = curves.points && curves.n.some((n) => n > 1);
  $("curves-note").textContent = !curves.steps ? "No steps yet: curves appear after the first optim_step." :
    `${curves.steps} steps` + (wide ? `, shown as ${curves.points} points (each the mean of its steps; the band is their min..max)` : "");
  $("charts").replaceChildren(...CHARTS.map(([key, title]) => chart(curves, key, title)));
}

// ---- a chart: plain SVG, the mean as a line, min..max as a band, hover for exact values ---------
const W = 440, H = 190, M = { left: 58, right: 10, top: 10, bottom: 24 };

function niceTicks(lo, hi, count) {
  const step0 = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= step0) || step0;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

function chart(curves, key, title) {
  const s = curves.series[key];
  const xs = curves.step;
  const idx = xs.map((_, i) => i).filter((i) => s.mean[i] !== null && xs[i] !== null);
  const last = idx.length ? s.mean[idx[idx.length - 1]] : null;
  const box = el("figure", { class: "chart", "data-series": key },
    el("figcaption", {}, title, el("span", { class: "latest" }, last === null ? "" : fmtNum(last))));
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, "data-series": key, role: "img", "aria-label": title });
  box.append(svg);
  if (!idx.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = "no values";
    svg.append(t);
    return box;
  }
  let x0 = Math.min(...idx.map((i) => xs[i])), x1 = Math.max(...idx.map((i) => xs[i]));
  let y0 = Math.min(...idx.map((i) => (s.min[i] ?? s.mean[i]))), y1 = Math.max(...idx.map((i) => (s.max[i] ?? s.mean[i])));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (key === "skipped") { y0 = 0; y1 = 1; }  // a fraction of the steps
  if (y0 === y1) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const px = (x) => M.left + (x - x0) / (x1 - x0) * (W - M.left - M.right);
  const py = (y) => H - M.bottom - (y - y0) / (y1 - y0) * (H - M.top - M.bottom);
  const axes = svgEl("g", { class: "axes" });
  for (const t of niceTicks(y0, y1, 4)) {
    axes.append(svgEl("line", { x1: M.left, x2: W - M.right, y1: py(t), y2: py(t), class: "grid" }));
    const label = svgEl("text", { x: M.left - 6, y: py(t) + 4, "text-anchor": "end" });
    label.textContent = fmtNum(t);
    axes.append(label);
  }
  for (const t of niceTicks(x0, x1, 6).filter((t) => Number.isInteger(t))) {
    const label = svgEl("text", { x: px(t), y: H - 6, "text-anchor": "middle" });
    label.textContent = String(t);
    axes.append(label);
  }
  svg.append(axes);
  if (idx.some((i) => curves.n[i] > 1 && s.min[i] !== null)) {
    const band = idx.filter((i) => s.min[i] !== null);
    const upper = band.map((i) => `${px(xs[i]).toFixed(1)},${py(s.max[i]).toFixed(1)}`);
    const lower = band.slice().reverse().map((i) => `${px(xs[i]).toFixed(1)},${py(s.min[i]).toFixed(1)}`);
    svg.append(svgEl("polygon", { points: upper.concat(lower).join(" "), class: "band" }));
  }
  let d = "", prev = -2;
  for (const i of idx) {
    d += `${i === prev + 1 ? "L" : "M"}${px(xs[i]).toFixed(1)},${py(s.mean[i]).toFixed(1)}`;
    prev = i;
  }
  svg.append(svgEl("path", { d, class: "line", "data-series": key, "data-points": idx.length }));
  if (idx.length <= 60) {
    for (const i of idx) svg.append(svgEl("circle", { cx: px(xs[i]).toFixed(1), cy: py(s.mean[i]).toFixed(1), r: 2.2, class: "dot" }));
  }
  const marker = svgEl("line", { y1: M.top, y2: H - M.bottom, class: "marker", visibility: "hidden" });
  svg.append(marker);
  svg.addEventListener("mousemove", (ev) => {
    const rect = svg.getBoundingClientRect();
    const x = (ev.clientX - rect.left) / rect.width * W;
    let best = idx[0];
    for (const i of idx) if (Math.abs(px(xs[i]) - x) < Math.abs(px(xs[best]) - x)) best = i;
    marker.setAttribute("x1", px(xs[best])); marker.setAttribute("x2", px(xs[best]));
    marker.setAttribute("visibility", "visible");
    showTooltip(ev, hoverText(curves, key, title, best));
  });
  svg.addEventListener("mouseleave", () => { marker.setAttribute("visibility", "hidden"); $("tooltip").hidden = true; });
  return box;
}

function hoverText(curves, key, title, i) {
  const s = curves.series[key], n = curves.n[i];
  const steps = n > 1 ? `steps ${curves.step_first[i]}-${curves.step[i]} (${n})` : `step ${curves.step[i]}`;
  if (key === "skipped") return [steps, `${title}: ${Math.round(s.mean[i] * n)} of ${n}`];
  if (n === 1) return [steps, `${title}: ${s.mean[i]}`];  // the exact value, every digit
  return [steps, `${title}: mean ${s.mean[i]}`, `min ${s.min[i]}`, `max ${s.max[i]}`];
}

function showTooltip(ev, lines) {
  const tip = $("tooltip");
  tip.replaceChildren(...lines.map((l) => el("div", {}, l)));
  tip.hidden = false;
  tip.style.left = `${Math.min(ev.pageX + 14, window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 8)}px`;
  tip.style.top = `${ev.pageY + 14}px`;
}

// ---- the server (operators) ------------------------------------------------------------------
function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) => el("td", {}, c))))));
}

function renderServer(srv) {
  const parts = [];
  const mem = srv.memory;
  parts.push(el("p", {}, `memory in use ${fmtBytes(mem.used_bytes)}` +
    (mem.max_memory_bytes ? ` of ${fmtBytes(mem.max_memory_bytes)} (--max-memory)` : " (no --max-memory)") +
    ` · weight snapshots ${srv.snapshots.count}, ${fmtBytes(srv.snapshots.bytes)} of ${fmtBytes(srv.snapshots.max_bytes)}` +
    `, ${srv.snapshots.evictions} evicted`));
  parts.push(el("h3", {}, "Shared bases"));
  parts.push(srv.bases.length ? table(
    ["model", "dtype / device", "base", "adapters in memory", "offloaded", "adapter memory", "offloads / reloads"],
    srv.bases.map((b) => [b.model, `${b.dtype} / ${b.device}`, fmtBytes(b.base_bytes),
      `${b.adapters_in_memory}${b.max_adapters ? ` of ${b.max_adapters}` : ""}`, b.adapters_offloaded,
      fmtBytes(b.adapter_bytes), `${b.offloads} / ${b.reloads}`])) : el("p", { class: "muted" }, "none loaded"));
  const adapters = srv.bases.flatMap((b) => b.adapters.map((a) => [b.model, a.model_id ?? "(sampler)", a.owner ?? "",
    a.rank, fmtBytes(a.bytes), a.offloaded ? "offloaded" : "in memory"]));
  if (adapters.length) parts.push(table(["base", "model id", "owner", "rank", "size", "where"], adapters));
  if (srv.own_copies.length) {
    parts.push(el("h3", {}, "Own copies"));
    parts.push(table(["model", "kind", "size"], srv.own_copies.map((c) => [c.model, c.lora ? "LoRA" : "full", fmtBytes(c.bytes)])));
  }
  if (srv.weight_syncs && srv.weight_syncs.length) {
    parts.push(el("h3", {}, "Weight syncs (last one per model: what the next sample waited)"));
    parts.push(table(["model id", "owner", "sampler", "kind", "waited", "size", "version", "engines", "transfer"],
      srv.weight_syncs.map((w) => [w.model_id, w.owner, w.sampler, w.kind ?? "",
        w.seconds == null ? "" : `${w.seconds.toFixed(3)} s`, w.bytes == null ? "" : fmtBytes(w.bytes),
        w.version ?? "", w.engines ?? 1, w.transfer ?? "in process"])));
  }
  parts.push(el("h3", {}, "Work per owner"));
  parts.push(srv.work.length ? table(["owner", "live models", "busy models", "requests in flight"],
    srv.work.map((w) => [w.owner, w.live_models, w.busy_models, w.requests_in_flight])) : el("p", { class: "muted" }, "idle"));
  parts.push(el("h3", {}, "Limits"));
  const l = srv.limits;
  parts.push(table(["limit", "value"], [
    ["engine", l.engine], ["sampler", Object.keys(l.sampler_config).length ? `${l.sampler} ${JSON.stringify(l.sampler_config)}` : l.sampler],
    ["models", l.models.join(", ")], ["shared base", l.share_base ? "on" : "off"],
    ["--max-memory", l.max_memory_bytes ? fmtBytes(l.max_memory_bytes) : "none"],
    ["--max-lora-adapters", l.max_lora_adapters ?? "none"], ["--snapshot-memory", fmtBytes(l.snapshot_memory_bytes)],
    ["--session-timeout", `${l.session_timeout_s} s`], ["--max-seq-len", l.max_seq_len ?? "the model's"],
    ["--max-num-samples", l.max_num_samples], ["--max-tokens-per-request", l.max_tokens_per_request],
    ["--max-queued-requests", l.max_queued_requests], ["--header-timeout", `${l.header_timeout_s} s`],
    ["--max-connections", l.max_connections], ["request body", fmtBytes(l.max_body_bytes)]]));
  $("server").replaceChildren(...parts);
}

// ---- wiring ---------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("key-input").value = "";
    start();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    sessionStorage.removeItem(RUN_ITEM);
    showLogin("");
  });
  $("checkpoints-more").addEventListener("click", () => { state.allCheckpoints = true; tick(); });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); tick(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; tick(); });
  takeFragment();
  start();
});
