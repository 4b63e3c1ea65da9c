// The debugger view: six linked panes. Selecting an execution anywhere (alert, timeline cell,
// list row, graph node) shows it everywhere: graph, stack, source, timeline window, list row.

import { h, clear, fmt, opName, healthClass, summaryBadges, outputText } from "./util.js";
import { runApi } from "./api.js";
import { VirtualList } from "./vlist.js";
import { Timeline } from "./timeline.js";
import { AlertsPane, renderGraph } from "./panes.js";
import { SourcePane, StackPane } from "./source.js";

function pane(cls, title, ...body) {
  return h(`section.pane.${cls}`, h("h2", title), ...body);
}

export class DebuggerView {
  constructor(root, runId, summary, hooks) {
    this.root = root;
    this.runId = runId;
    this.summary = summary;
    this.hooks = hooks;
    this.api = runApi(runId, hooks.rank);
    this.seq = null;
    this.filters = {};
  }

  async mount(seq) {
    const alerts = pane("p-alerts", "Alerts", h("div.body"));
    const timeline = pane("p-timeline", "Execution timeline", h("div.body"));
    const graph = pane("p-graph", "Graph structure", h("div.body#graph"));
    const list = pane("p-list", "Executions", this.filterBar(), this.listHead(), h("div.vl-host", { style: { display: "flex", flexDirection: "column", flex: "1", minHeight: "0" } }));
    const source = pane("p-source", "Source code", h("div.source-code#source"));
    const stack = pane("p-stack", "Stack trace", h("div.body#stack"));
    clear(this.root, h("div.debugger#debugger", alerts, h("div.p-middle", timeline, graph), list, source, stack));
    this.listTitle = list.querySelector("h2");
    this.graphBody = graph.querySelector(".body");
    clear(this.graphBody, h("div.empty", this.summary.nonfinite
      ? "Click the NaN/∞ alert to jump to the first execution that made a non-finite value, or pick any execution."
      : "Pick an execution in the timeline or the list to see its inputs, its consumers and where it ran."));

    this.alerts = new AlertsPane(alerts, { onSelect: (s) => this.select(s) });
    this.timeline = new Timeline(timeline, { api: this.api, onSelect: (s) => this.select(s), onJump: (i) => this.list.scrollToIndex(i) });
    this.source = new SourcePane(source, this.api);
    this.stack = new StackPane(stack, { onFrame: (f) => this.source.show(f) });
    this.list = new VirtualList(list.querySelector(".vl-host"), {
      fetchPage: (b, e) => this.api.executions(b, e, this.filters),
      renderRow: (d) => this.row(d),
      onTotal: (n) => clear(this.listTitle, "Executions", h("span.count", fmt(n)),
        Object.keys(this.filters).length ? h("span.small.muted", "(filtered)") : null),
      onError: (err) => this.hooks.error(err),
    });
    this.list.scroll.addEventListener("keydown", (e) => this.key(e));

    if (!this.summary.executions) {
      clear(this.graphBody, h("div.empty", "This run recorded no executions (training data only?): see the Training view."));
    }
    const [alertData, tl, first] = await Promise.all([
      this.api.alerts(), this.api.timeline(), this.api.executions(0, 200),
    ]);
    this.alerts.show(alertData);
    if ((this.summary.ranks || []).length > 1 && (await this.showRanks())) return; // went to another rank
    this.timeline.setSteps(tl);
    this.list.pages.set(0, { begin: 0, items: first.items });
    this.list.setTotal(first.total);
    this.timeline.items = first.items.slice(0, this.timeline.width);
    this.timeline.renderCells();
    this.timeline.draw();
    document.body.dataset.ready = "debugger";
    performance.mark("trainguard:debugger-ready"); // read by benchmarks/bench_ui.py
    if (seq !== null && seq !== undefined) await this.select(seq);
    if (alertData.total) this.api.origin().then((o) => this.alerts.showOrigin(o), () => {});
  }

  /** Every rank's alerts above this rank's; true when the page moves on to the rank that made the
   *  first non-finite value (opened without a rank, like `trainguard report`). */
  async showRanks() {
    let ans;
    try {
      ans = await this.api.ranks();
    } catch (err) {
      this.hooks.error(err);
      return false;
    }
    const report = ans && ans.available ? ans.result : null;
    if (!report) return false;
    const current = this.hooks.rank !== null && this.hooks.rank !== undefined ? this.hooks.rank : this.summary.ranks[0];
    if ((this.hooks.rank === null || this.hooks.rank === undefined) && report.first_rank !== null
        && report.first_rank !== current) {
      this.hooks.goRank(report.first_rank, true);
      return true;
    }
    this.alerts.showRanks(report, current, (rank) => this.hooks.goRank(rank, false));
    return false;
  }

  filterBar() {
    const health = h("select", { title: "Output health", on: { change: (e) => this.setFilter("health", e.target.value) } },
      h("option", { value: "" }, "any health"), h("option", { value: "nonfinite" }, "NaN or ∞"),
      h("option", { value: "nan" }, "NaN"), h("option", { value: "inf" }, "±∞"), h("option", { value: "ok" }, "finite"));
    const phase = h("select", { title: "Phase", on: { change: (e) => this.setFilter("phase", e.target.value) } },
      h("option", { value: "" }, "any phase"), ...["forward", "backward", "optimizer", "other"].map((p) => h("option", { value: p }, p)));
    const op = h("input", { placeholder: "op, e.g. log", title: "Keep one op type (Enter)",
      on: { change: (e) => this.setFilter("op", e.target.value.trim()) } });
    const step = h("input", { placeholder: "step or A:B", title: "Keep one step or a range (Enter)", style: { width: "80px" },
      on: { change: (e) => this.setFilter("step", e.target.value.trim()) } });
    return h("div.filters", health, phase, op, step);
  }

  listHead() {
    return h("div.vl-head", h("span", "#"), h("span", "step"), h("span", "phase"), h("span", "op"), h("span", "module"), h("span", "output"));
  }

  row(d) {
    return h("div.vl-row", {
      class: [healthClass(d) ? "bad" : "", d.seq === this.seq ? "sel" : ""].filter(Boolean).join(" "),
      dataset: { seq: d.seq },
      on: { click: () => this.select(d.seq) },
    },
    h("span.seq", d.seq), h("span", d.step), h("span", h("span.chip", { class: d.phase }, d.phase)),
    h("span.op", { title: d.op }, opName(d.op)), h("span.mod", { title: d.module || "" }, d.module || ""),
    h("span", h("span.badge.dtype", outputText(d)), summaryBadges((d.outputs[0] || {}).summary, { size: false })));
  }

  async setFilter(key, value) {
    if (value) this.filters[key] = value;
    else delete this.filters[key];
    try {
      const first = await this.api.executions(0, 200, this.filters);
      this.list.reset(0);
      this.list.pages.set(0, { begin: 0, items: first.items });
      this.list.setTotal(first.total);
      if (this.seq !== null) this.scrollListTo(this.seq);
    } catch (err) {
      this.hooks.error(err);
    }
  }

  key(e) {
    if (this.seq === null || !["ArrowDown", "ArrowUp", "j", "k"].includes(e.key)) return;
    e.preventDefault();
    const rows = [...this.list.win.querySelectorAll(".vl-row[data-seq]")];
    const i = rows.findIndex((r) => Number(r.dataset.seq) === this.seq);
    const next = rows[i + (e.key === "ArrowDown" || e.key === "j" ? 1 : -1)];
    if (next) this.select(Number(next.dataset.seq));
  }

  async scrollListTo(seq) {
    let index;
    if (Object.keys(this.filters).length) {
      index = (await this.api.position(seq, this.filters)).index;
    } else {
      index = this.detail && this.detail.seq === seq ? this.detail.index : (await this.api.position(seq)).index;
    }
    if (seq === this.seq) this.list.scrollToIndex(index);
  }

  async select(seq) {
    seq = Number(seq);
    if (!Number.isInteger(seq) || seq < 0) return;
    this.seq = seq;
    const token = (this.token = {});
    let d;
    try {
      d = await this.api.execution(seq);
    } catch (err) {
      if (token !== this.token) return;
      clear(this.graphBody, h("div.empty", err.status === 404
        ? `Execution #${seq} is not in this run (never recorded, or evicted by the circular buffer).`
        : `Execution #${seq} cannot be read: ${err.message}`));
      return;
    }
    if (token !== this.token) return;
    this.detail = d;
    this.hooks.onSelect(seq);
    renderGraph(this.graphBody, d, { onSelect: (s) => this.select(s) });
    this.stack.show(d.stack, d.user_frame);
    this.source.show(d.user_frame);
    this.list.render();
    await Promise.all([this.timeline.focus(d.index, seq), this.scrollListTo(seq).catch((err) => this.hooks.error(err))]);
    document.body.dataset.selected = String(seq);
  }

  /** A live run moved on: new alerts, a longer timeline and list. */
  async refresh(summary) {
    this.summary = summary;
    const [alertData, tl, page] = await Promise.all([
      this.api.alerts(), this.api.timeline(), this.api.executions(0, 1, this.filters),
    ]);
    this.alerts.show(alertData);
    this.timeline.setSteps(tl);
    this.list.setTotal(page.total);
    if (this.timeline.begin + this.timeline.items.length >= this.timeline.total - this.timeline.width) this.timeline.reload();
  }

  destroy() {
    this.list.destroy();
    this.timeline.destroy();
  }
}

