// skyrl-sdk console: one chart per series, plain SVG. Each run's mean is a line (the run the page
// shows, and a second run to compare on the same axes), min..max a band where a point merges
// several steps; the mouse over a chart shows the exact values at the nearest step.
"use strict";

const Charts = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 440, H = 190, M = { right: 10, top: 10, bottom: 24 };

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function fmtNum(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
    return String(Number(v.toPrecision(4)));
  }

  function niceStep(lo, hi, count) {
    const step0 = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(step0)));
    return [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= step0) || step0;
  }

  function niceTicks(lo, hi, count) {
    const step = niceStep(lo, hi, count);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
    return ticks;
  }

  // a tick's label with as many decimals as its step needs (1.0000002 next to 1.0000004, not "1" twice)
  function fmtTick(v, step) {
    if (v === 0) return "0";
    const decimals = Math.max(0, -Math.floor(Math.log10(step)));
    if (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3 || decimals > 9) return fmtNum(v);
    return v.toFixed(decimals);
  }

  // the points of one run's series that have a value: [{i, x, mean, min, max, n}]
  function pointsOf(curves, key) {
    const s = curves.series[key];
    if (!s) return [];
    return curves.step.map((x, i) => ({ i, x, mean: s.mean[i], min: s.min[i], max: s.max[i], n: curves.n[i] }))
      .filter((p) => p.mean !== null && p.mean !== undefined && p.x !== null);
  }

  function hasValues(curves, key) { return pointsOf(curves, key).length > 0; }

  // runs: [{curves, label, cls}] (the first is the page's run); onHover(lines | null, event)
  function chart(runs, key, title, note, onHover) {
    const series = runs.map((r) => ({ ...r, pts: pointsOf(r.curves, key) }));
    const own = series[0].pts;
    const last = own.length ? own[own.length - 1].mean : null;
    const box = document.createElement("figure");
    box.className = "chart";
    box.dataset.series = key;
    const caption = document.createElement("figcaption");
    caption.append(document.createTextNode(title));
    const latest = document.createElement("span");
    latest.className = "latest";
    latest.textContent = last === null ? "" : fmtNum(last);
    caption.append(latest);
    box.append(caption);
    if (note) {
      const p = document.createElement("p");
      p.className = "chart-note";
      p.textContent = note;
      box.append(p);
    }
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, "data-series": key, role: "img", "aria-label": title });
    box.append(svg);
    const all = series.flatMap((s) => s.pts);
    if (!all.length) {
      const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
      t.textContent = "no values";
      svg.append(t);
      return box;
    }
    let x0 = Math.min(...all.map((p) => p.x)), x1 = Math.max(...all.map((p) => p.x));
    let y0 = Math.min(...all.map((p) => p.min ?? p.mean)), y1 = Math.max(...all.map((p) => p.max ?? p.mean));
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (key === "skipped" || key === "clip_fraction") { y0 = Math.min(0, y0); y1 = Math.max(1, y1); }  // fractions
    if (y0 === y1) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
    const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    const yStep = niceStep(y0, y1, 4);
    const yTicks = niceTicks(y0, y1, 4).map((t) => [t, fmtTick(t, yStep)]);
    const left = Math.max(40, 12 + 6.4 * Math.max(...yTicks.map(([, label]) => label.length)));  // room for the labels
    const px = (x) => left + (x - x0) / (x1 - x0) * (W - left - M.right);
    const py = (y) => H - M.bottom - (y - y0) / (y1 - y0) * (H - M.top - M.bottom);
    const axes = svgEl("g", { class: "axes" });
    for (const [t, text] of yTicks) {
      axes.append(svgEl("line", { x1: left, x2: W - M.right, y1: py(t), y2: py(t), class: "grid" }));
      const label = svgEl("text", { x: left - 6, y: py(t) + 4, "text-anchor": "end" });
      label.textContent = text;
      axes.append(label);
    }
    for (const t of niceTicks(x0, x1, 6).filter((t) => Number.isInteger(t))) {
      const label = svgEl("text", { x: px(t), y: H - 6, "text-anchor": "middle" });
      label.textContent = String(t);
      axes.append(label);
    }
    svg.append(axes);
    // the compared run first, so the page's own run is drawn on top
    for (const s of series.slice().reverse()) {
      if (!s.pts.length) continue;
      if (s.pts.some((p) => p.n > 1 && p.min !== null)) {
        const band = s.pts.filter((p) => p.min !== null);
        const upper = band.map((p) => `${px(p.x).toFixed(1)},${py(p.max).toFixed(1)}`);
        const lower = band.slice().reverse().map((p) => `${px(p.x).toFixed(1)},${py(p.min).toFixed(1)}`);
        svg.append(svgEl("polygon", { points: upper.concat(lower).join(" "), class: `band ${s.cls}` }));
      }
      let d = "", prev = -2;
      for (const p of s.pts) {
        d += `${p.i === prev + 1 ? "L" : "M"}${px(p.x).toFixed(1)},${py(p.mean).toFixed(1)}`;
        prev = p.i;
      }
      svg.append(svgEl("path", { d, class: `line ${s.cls}`, "data-series": key, "data-run": s.label,
                                 "data-points": s.pts.length }));
      if (s.pts.length <= 60) {
        for (const p of s.pts) svg.append(svgEl("circle", { cx: px(p.x).toFixed(1), cy: py(p.mean).toFixed(1), r: 2.2,
                                                            class: `dot ${s.cls}` }));
      }
    }
    const marker = svgEl("line", { y1: M.top, y2: H - M.bottom, class: "marker", visibility: "hidden" });
    svg.append(marker);
    svg.addEventListener("mousemove", (ev) => {
      const rect = svg.getBoundingClientRect();
      const x = (ev.clientX - rect.left) / rect.width * W;
      let best = all[0];
      for (const p of all) if (Math.abs(px(p.x) - x) < Math.abs(px(best.x) - x)) best = p;
      marker.setAttribute("x1", px(best.x)); marker.setAttribute("x2", px(best.x));
      marker.setAttribute("visibility", "visible");
      onHover(hoverText(series, key, title, best.x), ev);
    });
    svg.addEventListener("mouseleave", () => { marker.setAttribute("visibility", "hidden"); onHover(null, null); });
    return box;
  }

  function hoverText(series, key, title, x) {
    const lines = [];
    for (const s of series) {
      const p = s.pts.find((q) => q.x === x);
      if (!p) continue;
      const steps = p.n > 1 ? `steps ${s.curves.step_first[p.i]}-${p.x} (${p.n})` : `step ${p.x}`;
      const who = series.length > 1 ? `${s.label}: ` : "";
      if (!lines.length || series.length > 1) lines.push(`${who}${steps}`);
      if (key === "skipped") lines.push(`${title}: ${Math.round(p.mean * p.n)} of ${p.n}`);
      else if (p.n === 1) lines.push(`${title}: ${p.mean}`);  // the exact value, every digit
      else lines.push(`${title}: mean ${p.mean}`, `min ${p.min}`, `max ${p.max}`);
    }
    return lines;
  }

  return { chart, fmtNum, hasValues };
})();
