// The execution timeline: an overview strip of every step (non-finite steps in red) and, below,
// the ops of the current window in order, one cell each, coloured by health.

import { h, clear, fmt, opName, healthClass, debounce } from "./util.js";

const CELL = 20; // px per cell including the gap
const ROWS = 2; // rows of cells in the window

export class Timeline {
  constructor(pane, { api, onSelect, onJump }) {
    this.api = api;
    this.onSelect = onSelect;
    this.onJump = onJump;
    this.total = 0;
    this.steps = [];
    this.begin = 0;
    this.items = [];
    this.selected = null;
    this.selectedIndex = null;
    this.title = h("span.count", "");
    this.range = h("span.range", "");
    this.prev = h("button.btn", { title: "Earlier executions", on: { click: () => this.page(-1) } }, "◀");
    this.next = h("button.btn", { title: "Later executions", on: { click: () => this.page(1) } }, "▶");
    this.goto = h("input", { placeholder: "go to #seq", title: "Select an execution by sequence number",
      on: { keydown: (e) => { if (e.key === "Enter" && e.target.value !== "") this.onSelect(Number(e.target.value)); } } });
    this.canvas = h("canvas.tl-overview", { title: "All executions, step by step; click to jump",
      on: { click: (e) => this.clickOverview(e) } });
    this.cells = h("div.tl-cells#timeline-cells");
    this.legend = h("div.tl-legend",
      h("span", h("i", { style: { background: "var(--ok)" } }), "finite"),
      h("span", h("i", { style: { background: "var(--nan)" } }), "NaN"),
      h("span", h("i", { style: { background: "var(--inf)" } }), "±∞"),
      h("span", h("i", { style: { background: "#74c0fc" } }), "forward"),
      h("span", h("i", { style: { background: "#b197fc" } }), "backward"),
      h("span", h("i", { style: { background: "#ffa94d" } }), "optimizer"));
    clear(pane.querySelector("h2"), "Execution timeline", this.title);
    clear(pane.querySelector(".body"),
      h("div.tl-bar", this.prev, this.range, this.next, h("span.grow"), this.goto),
      this.canvas, this.cells, this.legend);
    this.resize = new ResizeObserver(debounce(() => { this.draw(); this.reload(); }, 120));
    this.resize.observe(this.cells);
  }

  destroy() {
    this.resize.disconnect();
  }

  get width() {
    // leave room for the step labels that start each step's run of cells
    return Math.max(16, Math.floor((this.cells.clientWidth || 600) / CELL) * ROWS - 6);
  }

  /** Steps as [[step, first, last, count, nonfinite], ...] from /timeline. */
  setSteps(timeline) {
    this.total = timeline.total;
    this.steps = timeline.steps;
    this.title.textContent = `${fmt(this.total)} executions in ${fmt(this.steps.length)} steps`;
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const W = Math.max(1, Math.floor(c.clientWidth * dpr));
    const H = Math.max(1, Math.floor(c.clientHeight * dpr));
    c.width = W;
    c.height = H;
    const g = c.getContext("2d");
    g.clearRect(0, 0, W, H);
    if (!this.total) return;
    let pos = 0;
    let shade = false;
    const bad = [];
    for (const [, , , count, nonfinite] of this.steps) {
      const x0 = (pos / this.total) * W;
      const x1 = ((pos + count) / this.total) * W;
      if (x1 - x0 >= 3) {
        g.fillStyle = shade ? "#dee2e6" : "#e9ecef";
        g.fillRect(x0, H * 0.25, x1 - x0, H * 0.5);
        shade = !shade;
      }
      if (nonfinite) bad.push([x0, x1]);
      pos += count;
    }
    if (this.steps.length && (W / this.steps.length) < 3) {
      g.fillStyle = "#e9ecef";
      g.fillRect(0, H * 0.25, W, H * 0.5);
    }
    g.fillStyle = "#c2255c";
    for (const [x0, x1] of bad) g.fillRect(x0, H * 0.15, Math.max(2 * dpr, x1 - x0), H * 0.7);
    // the window shown below
    const wx0 = (this.begin / this.total) * W;
    const wx1 = (Math.min(this.total, this.begin + this.width) / this.total) * W;
    g.strokeStyle = "#f59f00";
    g.lineWidth = 2 * dpr;
    g.strokeRect(wx0 + dpr, dpr, Math.max(3 * dpr, wx1 - wx0 - 2 * dpr), H - 2 * dpr);
    if (this.selectedIndex !== null) {
      const x = (this.selectedIndex / this.total) * W;
      g.fillStyle = "#1f2733";
      g.fillRect(x - dpr, 0, 2 * dpr, H);
    }
  }

  clickOverview(e) {
    if (!this.total) return;
    const r = this.canvas.getBoundingClientRect();
    const index = Math.floor(((e.clientX - r.left) / r.width) * this.total);
    this.show(Math.max(0, index - Math.floor(this.width / 2)));
    if (this.onJump) this.onJump(index);
  }

  page(dir) {
    this.show(this.begin + dir * this.width);
  }

  /** Make sure row ``index`` (seq ``seq``) is in the window, and mark it. */
  focus(index, seq) {
    this.selected = seq;
    this.selectedIndex = index;
    if (index < this.begin || index >= this.begin + this.items.length || !this.items.length) {
      return this.show(Math.max(0, index - Math.floor(this.width / 3)));
    }
    this.renderCells();
    this.draw();
    return Promise.resolve();
  }

  reload() {
    return this.show(this.begin);
  }

  async show(begin) {
    const width = this.width;
    begin = Math.max(0, Math.min(begin, Math.max(0, this.total - width)));
    this.begin = begin;
    const token = (this.token = {});
    const res = await this.api.executions(begin, begin + width);
    if (token !== this.token) return;
    this.items = res.items;
    this.begin = res.begin;
    if (res.total !== this.total && res.total > this.total) this.total = res.total;
    this.renderCells();
    this.draw();
  }

  renderCells() {
    const n = this.items.length;
    this.range.textContent = n ? `#${fmt(this.begin)} – #${fmt(this.begin + n - 1)} of ${fmt(this.total)}` : "no executions";
    this.prev.disabled = this.begin <= 0;
    this.next.disabled = this.begin + n >= this.total;
    let prevStep = null;
    const out = [];
    for (const d of this.items) {
      if (d.step !== prevStep) {
        out.push(h("div.cell", { class: "steplabel", title: `step ${d.step}`, style: { width: "auto", padding: "0 4px", background: "none", color: "var(--muted)" } }, `s${d.step}`));
        prevStep = d.step;
      }
      const name = opName(d.op);
      const letter = (name.replace(/^_+/, "")[0] || "?").toUpperCase();
      out.push(h("div.cell", {
        class: [d.phase, healthClass(d), d.seq === this.selected ? "sel" : ""].filter(Boolean).join(" "),
        title: `#${d.seq}  step ${d.step}  ${d.phase}\n${name}${d.module ? `  (${d.module})` : ""}${d.health.length ? `\n${d.health.join(", ")}` : ""}`,
        dataset: { seq: d.seq },
        on: { click: () => this.onSelect(d.seq) },
      }, letter));
    }
    clear(this.cells, out);
  }
}
