// Plain SVG line charts and a canvas heatmap: enough for loss curves, schedules, LR range tests
// and per-layer statistics, with NaN/Inf drawn as marks instead of silently dropped.

import { h, fmt, num, tip } from "./util.js";

const SVG = "http://www.w3.org/2000/svg";

function s(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceTicks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const span = hi - lo;
  const step0 = Math.pow(10, Math.floor(Math.log10(span / n)));
  const err = (n * step0) / span;
  const step = step0 * (err <= 0.15 ? 10 : err <= 0.35 ? 5 : err <= 0.75 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function logTicks(lo, hi) {
  const out = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    const v = Math.pow(10, e);
    if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
  }
  return out.length ? out : [lo, hi];
}

/**
 * series: [{name, points: [[x, y], ...], cls}] with y possibly "NaN"/"Infinity".
 * opts: {width, height, logX, logY, marks: [{x, label}], xLabel}
 */
export function lineChart(series, opts = {}) {
  const W = Math.max(200, opts.width || 600);
  const H = opts.height || 220;
  const m = { l: 52, r: 12, t: 16, b: 26 };
  const pw = W - m.l - m.r;
  const ph = H - m.t - m.b;
  const finite = [];
  const bad = [];
  for (const se of series) {
    for (const [x, yv] of se.points) {
      const y = num(yv);
      const xv = num(x);
      if (y === null || xv === null) continue;
      if (Number.isFinite(y) && (!opts.logY || y > 0)) finite.push([xv, y]);
      else if (!Number.isFinite(y)) bad.push([xv, y, se.name]);
    }
  }
  const svg = s("svg", { class: "chart", width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  if (!finite.length && !bad.length) {
    svg.append(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no values"));
    return svg;
  }
  const xs = finite.map((p) => p[0]).concat(bad.map((p) => p[0]));
  let x0 = Math.min(...xs);
  let x1 = Math.max(...xs);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let y0 = finite.length ? Math.min(...finite.map((p) => p[1])) : 0;
  let y1 = finite.length ? Math.max(...finite.map((p) => p[1])) : 1;
  if (y0 === y1) {
    const pad = Math.abs(y0) * 0.5 || 1; // a constant series sits mid-chart at its own scale
    y0 = opts.logY ? y0 / 2 : y0 - pad;
    y1 = opts.logY ? y1 * 2 : y1 + pad;
  }
  if (!opts.logY) { const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad; }
  const fx = opts.logX ? (x) => m.l + ((Math.log10(x) - Math.log10(x0)) / (Math.log10(x1) - Math.log10(x0))) * pw
    : (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
  const fy = opts.logY ? (y) => m.t + ph - ((Math.log10(y) - Math.log10(y0)) / (Math.log10(y1) - Math.log10(y0))) * ph
    : (y) => m.t + ph - ((y - y0) / (y1 - y0)) * ph;

  for (const t of opts.logY ? logTicks(y0, y1) : niceTicks(y0, y1)) {
    const y = fy(t);
    svg.append(s("line", { class: "grid", x1: m.l, x2: W - m.r, y1: y, y2: y }));
    svg.append(s("text", { x: m.l - 5, y: y + 3, "text-anchor": "end" }, fmt(t, 3)));
  }
  for (const t of opts.logX ? logTicks(x0, x1) : niceTicks(x0, x1, Math.max(2, Math.floor(pw / 80)))) {
    const x = fx(t);
    svg.append(s("line", { class: "axis", x1: x, x2: x, y1: m.t + ph, y2: m.t + ph + 4 }));
    svg.append(s("text", { x, y: H - 8, "text-anchor": "middle" }, fmt(t, 3)));
  }
  svg.append(s("line", { class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph }));
  svg.append(s("line", { class: "axis", x1: m.l, x2: W - m.r, y1: m.t + ph, y2: m.t + ph }));
  if (opts.xLabel) svg.append(s("text", { x: W - m.r, y: m.t - 4, "text-anchor": "end" }, opts.xLabel));

  series.forEach((se, i) => {
    let d = "";
    let pen = false;
    for (const [xv, yv] of se.points) {
      const y = num(yv);
      const x = num(xv);
      if (y === null || !Number.isFinite(y) || (opts.logY && y <= 0)) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${fx(x).toFixed(1)},${fy(y).toFixed(1)}`;
      pen = true;
    }
    svg.append(s("path", { class: `series ${se.cls || (i ? "s2" : "")}`, d, "data-series": se.name }));
  });
  // non-finite values: a triangle on the top edge at their step, and a note at the first one
  for (const [x, y, name] of bad) {
    const px = fx(x);
    const tri = s("path", { class: "nonfinite", d: `M${px - 4},${m.t - 8}L${px + 4},${m.t - 8}L${px},${m.t - 1}Z`, "data-step": x });
    tri.append(s("title", {}, `${name} = ${fmt(y)} at ${x}`));
    svg.append(tri);
  }
  if (bad.length) {
    const [bx, by] = bad.reduce((a, b) => (b[0] < a[0] ? b : a));
    svg.append(s("line", { class: "mark", x1: fx(bx), x2: fx(bx), y1: m.t, y2: m.t + ph }));
    const left = fx(bx) > W - 160;
    svg.append(s("text", { class: "note", x: fx(bx) + (left ? -6 : 6), y: m.t + 12, "text-anchor": left ? "end" : "start" },
      `${fmt(by)} from ${opts.xName || "step"} ${fmt(bx)}`));
  }
  for (const mk of opts.marks || []) {
    const x = num(mk.x);
    if (x === null || x < x0 || x > x1) continue;
    svg.append(s("line", { class: "mark", x1: fx(x), x2: fx(x), y1: m.t, y2: m.t + ph, style: "stroke:#2b8a3e" }));
    svg.append(s("text", { x: fx(x) + 5, y: m.t + ph - 6, style: "fill:#2b8a3e;font-weight:600" }, mk.label));
  }
  // hover: nearest x of the first series
  const hoverLine = s("line", { class: "hover-line", y1: m.t, y2: m.t + ph, visibility: "hidden" });
  const overlay = s("rect", { x: m.l, y: m.t, width: pw, height: ph, fill: "transparent" });
  const ref = series[0] ? series[0].points.map(([x]) => num(x)) : [];
  overlay.addEventListener("mousemove", (e) => {
    const r = svg.getBoundingClientRect();
    const px = ((e.clientX - r.left) / r.width) * W;
    let best = 0;
    for (let i = 1; i < ref.length; i++) if (Math.abs(fx(ref[i]) - px) < Math.abs(fx(ref[best]) - px)) best = i;
    if (!ref.length) return;
    const x = ref[best];
    hoverLine.setAttribute("x1", fx(x));
    hoverLine.setAttribute("x2", fx(x));
    hoverLine.setAttribute("visibility", "visible");
    const parts = series.map((se) => {
      const p = se.points.find(([px2]) => num(px2) === x);
      return `${se.name}=${p ? fmt(p[1]) : "—"}`;
    });
    tip(`${opts.xName || "step"} ${fmt(x)}  ${parts.join("  ")}`, e.clientX, e.clientY);
  });
  overlay.addEventListener("mouseleave", () => { hoverLine.setAttribute("visibility", "hidden"); tip(null); });
  svg.append(hoverLine, overlay);
  return svg;
}

const RAMP = [[248, 249, 250], [165, 216, 255], [28, 126, 214], [11, 61, 107]];

function ramp(t) {
  t = Math.max(0, Math.min(1, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(t));
  const f = t - i;
  const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

/** Layers x steps, one colour per cell; log colour scale when values span decades. */
export function heatmap(data, width) {
  const rows = data.layers.length;
  const cols = data.steps.length;
  const rowH = rows > 40 ? 10 : 18;
  const values = data.values.map((r) => r.map(num));
  const finite = values.flat().filter((v) => v !== null && Number.isFinite(v));
  const positive = finite.filter((v) => v > 0);
  const useLog = finite.length > 0 && positive.length === finite.length && Math.max(...positive) / Math.min(...positive) > 100;
  const tr = useLog ? (v) => Math.log10(v) : (v) => v;
  const tv = finite.map(tr);
  const lo = tv.length ? Math.min(...tv) : 0;
  const hi = tv.length ? Math.max(...tv) : 1;
  const labels = h("div.heat-labels", data.layers.map((l) => h("div", { style: { height: `${rowH}px` }, title: l }, l)));
  const canvas = h("canvas.heat", { style: { height: `${rows * rowH}px` } });
  const cw = Math.max(100, width - 160);
  canvas.width = Math.max(cols, Math.min(cw, cols * 24));
  canvas.height = rows * rowH;
  const g = canvas.getContext("2d");
  const cellW = canvas.width / cols;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = values[r][c];
      if (v === null) g.fillStyle = "#ffffff";
      else if (!Number.isFinite(v)) g.fillStyle = "#c2255c";
      else if (useLog && v <= 0) g.fillStyle = "#f8f9fa";
      else g.fillStyle = ramp(hi > lo ? (tr(v) - lo) / (hi - lo) : 0.5);
      g.fillRect(Math.floor(c * cellW), r * rowH, Math.ceil(cellW), rowH - 1);
    }
  }
  canvas.addEventListener("mousemove", (e) => {
    const rect = canvas.getBoundingClientRect();
    const c = Math.floor(((e.clientX - rect.left) / rect.width) * cols);
    const r = Math.floor(((e.clientY - rect.top) / rect.height) * rows);
    if (r < 0 || r >= rows || c < 0 || c >= cols) return tip(null);
    tip(`${data.layers[r]}  step ${data.steps[c]}  ${data.kind} ${data.stat} = ${fmt(data.values[r][c])}`, e.clientX, e.clientY);
  });
  canvas.addEventListener("mouseleave", () => tip(null));
  const legend = h("div.heat-legend",
    h("span", useLog ? `10^${lo.toFixed(1)}` : fmt(lo)), h("span.ramp"), h("span", useLog ? `10^${hi.toFixed(1)}` : fmt(hi)),
    h("span", useLog ? "(log scale)" : "(linear scale)"),
    h("span", h("i", { style: { display: "inline-block", width: "10px", height: "10px", background: "#c2255c" } }), " NaN/∞"),
    h("span", `steps ${data.steps[0]}–${data.steps[cols - 1]}`));
  return h("div", h("div.heat-wrap", labels, canvas), legend);
}
