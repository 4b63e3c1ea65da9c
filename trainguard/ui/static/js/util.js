// Small DOM and formatting helpers shared by the views.

/** h("div.cls#id", {attrs, on: {click}}, ...children): build an element. Text is never parsed as HTML.
 *  The attributes may be left out: a second argument that is not a plain object is the first
 *  child, whatever its value (0, NaN and "" render as text too). */
export function h(spec, attrs, ...children) {
  const m = /^([a-z0-9]+)?((?:[.#][\w-]+)*)$/i.exec(spec);
  const node = document.createElement((m && m[1]) || "div");
  if (m && m[2]) {
    for (const part of m[2].match(/[.#][\w-]+/g)) {
      if (part[0] === ".") node.classList.add(part.slice(1));
      else node.id = part.slice(1);
    }
  }
  if (attrs !== null && attrs !== undefined && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
    else if (k === "class") node.className += (node.className ? " " : "") + v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(node.style, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(node, c);
    else node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

/** The API spells non-finite numbers as strings; turn them back into numbers. */
export function num(v) {
  if (typeof v === "number") return v;
  if (v === "NaN") return NaN;
  if (v === "Infinity") return Infinity;
  if (v === "-Infinity") return -Infinity;
  if (v === null || v === undefined) return null;
  const x = Number(v);
  return Number.isNaN(x) ? null : x;
}

export function fmt(v, digits = 4) {
  const x = num(v);
  if (x === null) return "—";
  if (Number.isNaN(x)) return "NaN";
  if (x === Infinity) return "+∞";
  if (x === -Infinity) return "−∞";
  if (Number.isInteger(x) && Math.abs(x) < 1e12) return x.toLocaleString("en-US");
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
  return String(Number(x.toPrecision(digits)));
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function fmtTime(t) {
  if (!t) return "—";
  const d = new Date(num(t) * 1000);
  return d.toISOString().replace("T", " ").slice(0, 19);
}

/** aten.log -> log, aten.add_.Tensor -> add_.Tensor: the namespace says nothing in a list. */
export function opName(op) {
  return op && op.startsWith("aten.") ? op.slice(5) : op || "?";
}

export function basename(path) {
  return (path || "").split(/[\\/]/).pop();
}

/** Worst health of an execution digest: "nan", "inf" or "". */
export function healthClass(d) {
  const hs = d.health || [];
  if (hs.includes("nan") || hs.includes("unknown")) return "nan";
  if (hs.includes("+inf") || hs.includes("-inf")) return "inf";
  return "";
}

const BADGE_ORDER = [
  ["nan", "NaN", "nan"],
  ["neg_inf", "−∞", "inf"],
  ["pos_inf", "+∞", "inf"],
  ["zero", "0", "zero"],
];

/** Badges for one output summary: its size, then NaN/Inf/zero counts that are not zero. */
export function summaryBadges(summary, { size = true } = {}) {
  if (!summary) return [];
  const out = [];
  if ("nonfinite" in summary) {
    out.push(h("span.badge", { class: summary.nonfinite ? "nan" : "" }, summary.nonfinite ? "non-finite" : "finite"));
    return out;
  }
  if (size && "size" in summary) out.push(h("span.badge", { title: "elements" }, `size ${fmt(summary.size)}`));
  for (const [key, label, cls] of BADGE_ORDER) {
    const n = num(summary[key]);
    if (n) out.push(h(`span.badge.${cls}`, { title: key.replace("_", " ") }, `${label}×${fmt(n)}`));
  }
  if ("min" in summary) out.push(h("span.badge", { title: "min … max" }, `${fmt(summary.min, 3)}…${fmt(summary.max, 3)}`));
  return out;
}

export function outputText(d) {
  const o = (d.outputs || [])[0];
  if (!o) return "";
  const shape = Array.isArray(o.shape) ? `[${o.shape.join("×")}]` : "";
  return `${String(o.dtype || "").replace("torch.", "")}${shape}`;
}

export function debounce(fn, ms) {
  let t = null;
  return (...args) => {
    clearTimeout(t);
    t = setTimeout(() => fn(...args), ms);
  };
}

/** One floating tooltip shared by the charts. */
let tipNode = null;
export function tip(text, x, y) {
  if (!tipNode) {
    tipNode = h("div.tip");
    document.body.append(tipNode);
  }
  if (text === null) {
    tipNode.style.display = "none";
    return;
  }
  tipNode.textContent = text;
  tipNode.style.display = "block";
  tipNode.style.left = `${Math.min(x + 12, window.innerWidth - tipNode.offsetWidth - 6)}px`;
  tipNode.style.top = `${y + 14}px`;
}
