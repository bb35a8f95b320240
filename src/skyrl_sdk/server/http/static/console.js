// skyrl-sdk console: reads /console/api/* with the key kept in this tab's sessionStorage and
// draws runs, curves (charts.js: plain SVG) and checkpoints. Every value from the server is put
// in the page as text (textContent / attributes), never parsed as HTML. An RL run (its datums
// carry advantages) leads with the curves that say whether RL is healthy; a second run can be
// drawn on the same axes.
"use strict";

const KEY_ITEM = "skyrl-console-key";
const RUN_ITEM = "skyrl-console-run";
const POLL_MS = 2000;
const PAGE = 50;
const CHECKPOINTS_SHOWN = 10;  // the newest; a button shows the rest
// [series, title, note] per group; a chart with no value in the runs shown is left out (named below them)
const RL_CHARTS = [
  ["advantage_mean", "advantage mean", null], ["advantage_std", "advantage std", "0: the groups carried no signal"],
  ["kl_sample_train", "sampler − trainer logprob", "k1 estimate of KL(sampler ‖ trainer): 0 on policy"],
  ["ratio_max", "importance ratio max", null], ["clip_fraction", "clipped fraction", null],
  ["sampled_tokens", "sampled tokens per step", null],
];
const TRAINING_CHARTS = [
  ["loss_per_token", "loss per token", null], ["loss_sum", "loss:sum", null], ["grad_norm", "grad_norm", null],
  ["entropy", "entropy per token", null], ["learning_rate", "learning rate", null],
  ["tokens", "tokens per step", null], ["seconds", "seconds per step", null], ["skipped", "skipped steps", null],
  ["tokens_per_second", "tokens / s (forward_backward)", "the calls' own compute time"],
  ["mfu", "MFU", "model FLOPs over the device's peak (GPUs)"],
];
const ZERO_SUM_NOTE = "about 0 for an RL loss on group-normalized advantages: not a measure of progress";

const state = { me: null, offset: 0, selected: null, compare: null, runs: [], curvesSig: null, busy: false,
                timer: null, allCheckpoints: false };

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

// ---- the key --------------------------------------------------------------------------------
function takeFragment() {  // #key=...&run=...&compare=... (docs/server.md, Console)
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("key")) sessionStorage.setItem(KEY_ITEM, params.get("key"));
  if (params.get("run")) sessionStorage.setItem(RUN_ITEM, params.get("run"));
  if (params.get("compare")) state.compare = params.get("compare");
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
  $("runs-owner").textContent = `of owner ${state.me.owner}`;
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

const fmtNum = Charts.fmtNum;

// the last step in a few words: an RL run's health, a supervised run's loss per token
function headline(last) {
  if (!last) return "";
  if (last.rl_run) {
    const parts = [];
    if (last.kl_sample_train !== null && last.kl_sample_train !== undefined) parts.push(`KL s−t ${fmtNum(last.kl_sample_train)}`);
    if (last.advantage_std !== null && last.advantage_std !== undefined) parts.push(`adv std ${fmtNum(last.advantage_std)}`);
    return `RL: ${parts.join(" · ") || "nothing to train on in the last step"}`;
  }
  return last.loss_per_token === null || last.loss_per_token === undefined ? "" : `loss/token ${fmtNum(last.loss_per_token)}`;
}

function statusTitle(r) {
  if (r.status !== "gone") return null;
  return `no sign of life from its client for ${Math.round(r.client_silent_s)} s (its script ended without close()?); ` +
    `its models are freed after --session-timeout (${state.me ? state.me.session_timeout_s : "?"} s)`;
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
  state.runs = page.runs;
  const body = $("runs").tBodies[0];
  body.replaceChildren(...page.runs.map((r) => {
    const row = el("tr", { "data-run-id": r.model_id, class: r.model_id === state.selected ? "selected" : null },
      el("td", { class: "id" }, r.model_id), el("td", {}, r.base_model),
      el("td", {}, r.lora_rank === null ? "full" : `rank ${r.lora_rank}`), el("td", {}, (r.last && r.last.loss_fn) || ""),
      el("td", {}, fmtTime(r.created)),
      el("td", { title: fmtTime(r.last_request) }, fmtAgo(r.last_request)), el("td", { class: "num" }, r.steps),
      el("td", { class: "headline" }, headline(r.last)),
      el("td", {}, el("span", { class: `status ${r.status}`, title: statusTitle(r) },
                     r.status === "gone" ? "client gone" : r.status)),
      el("td", { class: "num" }, r.sampling_sessions));
    row.addEventListener("click", () => select(r.model_id));
    return row;
  }));
}

async function select(runId) {
  state.selected = runId;
  if (state.compare === runId) state.compare = null;
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
  const other = state.compare ? state.runs.find((r) => r.model_id === state.compare) : null;
  const sig = `${run.model_id}|${run.steps}|${state.compare}|${other ? other.steps : ""}`;
  if (sig !== state.curvesSig) {
    const curves = await api(`/console/api/runs/${encodeURIComponent(run.model_id)}/curves?points=1000`);
    let compared = null;
    if (state.compare) {
      try {
        compared = await api(`/console/api/runs/${encodeURIComponent(state.compare)}/curves?points=1000`);
      } catch (e) {
        if (e instanceof AuthError) throw e;
        state.compare = null;  // gone from this owner's runs
      }
    }
    renderCurves(curves, compared);
    state.curvesSig = sig;
  }
}

function renderCompare(runId) {
  const select = $("compare");
  const options = [el("option", { value: "" }, "none")].concat(
    state.runs.filter((r) => r.model_id !== runId).map((r) =>
      el("option", { value: r.model_id, selected: r.model_id === state.compare ? "" : null },
         `${r.model_id} (${r.steps} steps${r.last && r.last.loss_fn ? `, ${r.last.loss_fn}` : ""})`)));
  select.replaceChildren(...options);
  select.value = state.compare || "";
  select.disabled = options.length === 1;
}

// ---- one run ----------------------------------------------------------------------------------
function renderRun(run) {
  $("run-panel").hidden = false;
  $("run-panel").dataset.runId = run.model_id;
  $("run-title").textContent = run.model_id;
  renderCompare(run.model_id);
  const status = run.status === "gone" ? `client gone: ${statusTitle(run)}` : run.status;
  const info = [["base model", run.base_model], ["LoRA", run.lora_rank === null ? "full fine-tuning" : `rank ${run.lora_rank}`],
    ["loss", (run.last && run.last.loss_fn) || ""], ["status", status], ["steps", run.steps], ["created", fmtTime(run.created)],
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

function isRl(curves) {
  return !!curves && curves.series.rl && curves.series.rl.max.some((v) => v);
}

function renderCurves(curves, compared) {
  const wide = curves.points && curves.n.some((n) => n > 1);
  $("curves-note").textContent = !curves.steps ? "No steps yet: curves appear after the first optim_step." :
    `${curves.steps} steps` + (wide ? `, shown as ${curves.points} points (each the mean of its steps; the band is their min..max)` : "");
  const runs = [{ curves, label: curves.run_id, cls: "run-a" }];
  if (compared) runs.push({ curves: compared, label: compared.run_id, cls: "run-b" });
  $("legend").hidden = runs.length === 1;
  $("legend").replaceChildren(...runs.map((r) => el("span", { class: `swatch ${r.cls}` }, r.label)));
  const rl = isRl(curves) || isRl(compared);
  const hover = (lines, ev) => { if (lines) showTooltip(ev, lines); else $("tooltip").hidden = true; };
  const groups = rl ? [["RL (what the server sees; the rewards stay with the client)", RL_CHARTS],
                       ["Training", TRAINING_CHARTS]] : [["Training", TRAINING_CHARTS]];
  const parts = [];
  const empty = [];
  for (const [heading, charts] of groups) {
    const shown = charts.filter(([key]) => runs.some((r) => Charts.hasValues(r.curves, key)));
    empty.push(...charts.filter((c) => !shown.includes(c)).map(([, title]) => title));
    if (!shown.length) continue;
    parts.push(el("h3", { class: "chart-group" }, heading));
    const grid = el("div", { class: "chart-grid" });
    grid.replaceChildren(...shown.map(([key, title, note]) =>
      Charts.chart(runs, key, title, key === "loss_per_token" && rl ? ZERO_SUM_NOTE : note, hover)));
    parts.push(grid);
  }
  if (curves.steps && empty.length) parts.push(el("p", { class: "muted" }, `No values yet: ${empty.join(", ")}.`));
  $("charts").replaceChildren(...parts);
}

function showTooltip(ev, lines) {
  const tip = $("tooltip");
  tip.replaceChildren(...lines.map((l) => el("div", {}, l)));
  tip.hidden = false;
  tip.style.left = `${Math.min(ev.pageX + 14, window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 8)}px`;
  tip.style.top = `${ev.pageY + 14}px`;
}

// ---- the server (operators) ------------------------------------------------------------------
// a row of the limits table (the server declares them: server/settings.py)
function limitValue(r) {
  const v = r.value;
  if (v === null || v === undefined) return r.unset;
  if (r.unit === "bytes") return fmtBytes(v);
  if (r.unit === "s") return `${v} s`;
  if (typeof v === "boolean") return v ? "on" : "off";
  if (Array.isArray(v)) return v.join(", ");
  if (typeof v === "object") return Object.keys(v).length ? JSON.stringify(v) : "none";
  return String(v);
}

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
  parts.push(table(["setting", "value"], srv.limits.map((r) => [r.flag || r.setting, limitValue(r)])));
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
  $("compare").addEventListener("change", (ev) => {
    state.compare = ev.target.value || null;
    state.curvesSig = null;
    refreshRun().catch((e) => { $("error").textContent = String(e.message || e); });
  });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); tick(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; tick(); });
  takeFragment();
  start();
});
