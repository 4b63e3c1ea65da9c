// The alerts pane and the graph-structure pane of the debugger.

import { h, clear, fmt, opName, basename, healthClass, summaryBadges, outputText } from "./util.js";

/** The headline with each file named by its base name, as the panes show files. */
function shortPaths(report) {
  let text = report.headline;
  for (const p of report.per_rank) {
    if (p.first && p.first.file) text = text.split(p.first.file).join(basename(p.first.file));
  }
  return text;
}

/** "3,840 intended -inf from masked_fill, absorbed by softmax" (the report says the same). */
function intendedText(g) {
  const n = g.values ? fmt(g.values) : `${fmt(g.executions)} tensors of`;
  const short = (op) => opName(op).replace(/\.default$/, "");
  const made = short(g.made_by || "?");
  if (!g.absorbed_by) {
    return `${n} ${g.kind} from ${made} never reached the loss, a gradient, a parameter or a read value (not harmful)`;
  }
  const absorbed = short(g.absorbed_by);
  return g.chosen  // the op wrote a value the program chose (store/_reader_harm.py's chosen_by_program)
    ? `${n} intended ${g.kind} from ${made}, absorbed by ${absorbed}`
    : `${n} ${g.kind} from ${made}, absorbed by ${absorbed} (no NaN or Inf came of it; check what ${absorbed} made of it)`;
}

/** The gradients of steps a GradScaler skipped: routine fp16 overflow, never alerts (as the report says). */
function scalerText(sc) {
  const r = sc.ranges.slice(0, 6).map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(", ");
  const more = sc.ranges.length > 6 ? ` and ${sc.ranges.length - 6} more ranges` : "";
  const n = sc.skipped_steps;
  return `${fmt(sc.events)} Inf/NaN events in the gradients of ${fmt(n)} step${n === 1 ? "" : "s"} a GradScaler ` +
    `skipped (steps ${r}${more}; first #${sc.first_seq}): discarded with the update, never reached the weights`;
}

export class AlertsPane {
  constructor(pane, { onSelect }) {
    this.head = pane.querySelector("h2");
    this.body = pane.querySelector(".body");
    this.onSelect = onSelect;
    this.originBox = h("div.origin");
  }

  show(alerts) {
    this.alerts = alerts;
    clear(this.head, "Alerts", h("span.grow"), h("span.count", alerts.total ? fmt(alerts.total) : "0"));
    // Intended infinities (masks absorbed by softmax, sentinels) are a count, never an alert.
    const quiet = (alerts.intended || []).map((g) => h("div.small.muted.intended", intendedText(g)));
    if (alerts.scaler && alerts.scaler.events) quiet.push(h("div.small.muted.scaler", scalerText(alerts.scaler)));
    if (!alerts.total) {
      clear(this.body, this.ranksBox || null, h("div.alert-ok", "No harmful NaN or Inf."), quiet, this.originBox);
      return;
    }
    const total = h("div.alert-total#alert-nonfinite", {
      role: "button", tabindex: "0",
      title: "Select where the first harmful NaN or Inf was made",
      on: { click: () => this.pick(total, alerts.first_seq),
            keydown: (e) => { if (e.key === "Enter") this.pick(total, alerts.first_seq); } },
    }, h("span", "NaN / ∞"), h("span.n", `${fmt(alerts.total)} events`));
    const byOp = alerts.by_op.map((a) => {
      const row = h("div.alert-op", { title: `first at #${a.first_seq}`, dataset: { op: a.op, seq: a.first_seq },
        on: { click: () => this.pick(row, a.first_seq) } },
      h("span", opName(a.op)), h("span.n", `×${fmt(a.count)}`));
      return row;
    });
    clear(this.body, this.ranksBox || null, total, this.originBox, h("div.g-label", "by op type (first one first)"), byOp, quiet);
  }

  /** A multi-rank run: the first line (which rank made it, which received it) and a row per rank. */
  showRanks(report, current, onRank) {
    const rows = report.per_rank.map((p) => {
      const f = p.first;
      const how = !f ? "" : f.received_via ? "received" : p.rank === report.first_rank ? "made · first" : "made";
      const via = f && f.received_via ? ` · through ${opName(f.received_via.op)}` : "";
      return h(`div.rank-row${p.rank === current ? ".active" : ""}`, {
        role: "button", tabindex: "0", dataset: { rank: p.rank },
        title: f ? `step ${f.step}: ${f.op}${f.file ? ` at ${basename(f.file)}:${f.line}` : ""}` : "no NaN or Inf",
        on: { click: () => onRank(p.rank), keydown: (e) => { if (e.key === "Enter") onRank(p.rank); } },
      }, h("span.r", `rank ${p.rank}`), h("span.n", p.alerts.total ? `${fmt(p.alerts.total)} NaN/∞` : "clean"),
      h("span.small.how", how),
      f ? h("span.small.first", `step ${f.step} · ${opName(f.op)}${f.file ? ` · ${basename(f.file)}:${f.line}` : ""}${via}`) : null);
    });
    this.ranksBox = h("div.ranks#ranks",
      h("div.rank-headline#rank-headline", report.headline ? `${shortPaths(report)}.` : `No harmful NaN or Inf on any of the ${report.ranks.length} ranks.`),
      rows);
    this.body.prepend(this.ranksBox);
  }

  pick(node, seq) {
    for (const n of this.body.querySelectorAll(".active")) n.classList.remove("active");
    node.classList.add("active");
    this.onSelect(seq);
  }

  /** The analysis' walk back from the first non-finite value, or why it is not shown. */
  showOrigin(ans) {
    const box = this.originBox;
    if (!ans || (!ans.available && !ans.seq)) {
      clear(box);
      return;
    }
    if (!ans.available) {
      clear(box, h("h3", "Origin"),
        h("div.small.muted", `Explanation unavailable: ${ans.reason}.`),
        h("div.small", "First non-finite output: ", h("span.link", { on: { click: () => this.onSelect(ans.seq) } }, `#${ans.seq}`)));
      return;
    }
    // trainguard.analysis.origin: {summary, suggestion, origin: Link, chain: [Link, ...]},
    // chain[0] the execution asked about, chain[-1] where the non-finite value was made.
    const r = ans.result || {};
    const chain = Array.isArray(r) ? r : r.chain || [];
    const o = r.origin || chain[chain.length - 1] || null;
    const parts = [h("h3", "Origin")];
    if (o) {
      parts.push(h("div.link-row#origin-link",
        h("span.link", { on: { click: () => this.onSelect(o.seq) } }, `#${o.seq} ${opName(o.op)}`),
        o.file ? h("span.small.muted", `  ${basename(o.file)}:${o.line}${o.function ? ` in ${o.function}()` : ""}`) : null,
        h("div.small", `step ${o.step} · ${o.phase}${o.health && o.health.length ? ` · ${o.health.join(", ")}` : ""}`),
        o.explanation ? h("div.why", o.explanation) : null,
        r.harm ? h("div.small.harm", `Then ${r.harm.replace(/(\S*\/)([^/\s]+:\d+)/g, "$2")}`) : null));
      for (const inp of o.inputs || []) {
        if (!inp.producer_op) continue;
        parts.push(h("div.small", `input ${inp.slot} from `,
          h("span.link", { on: { click: () => this.onSelect(inp.producer) } }, `#${inp.producer} ${opName(inp.producer_op)}`),
          inp.description ? `: ${inp.description}` : ""));
      }
      // Inputs a compiled graph computed without summaries: the summarised values behind them.
      for (const src of o.sources || []) {
        parts.push(h("div.small.source-of", `computed (through ${(o.through || []).join(", ")}) from `,
          h("span.link", { on: { click: () => this.onSelect(src.producer) } }, `#${src.producer} ${opName(src.producer_op)}`),
          src.description ? `: ${src.description}` : ""));
      }
    } else if (r.summary) {
      parts.push(h("div.why", r.summary));
    }
    if (chain.length > 1) {
      parts.push(h("div.small.muted", `passed on by ${chain.length - 1} later op${chain.length > 2 ? "s" : ""}: `,
        chain.slice(0, -1).map((l) => h("span.link", { on: { click: () => this.onSelect(l.seq) } }, `#${l.seq} ${opName(l.op)} `))));
    }
    if (r.suggestion) parts.push(h("div.fix.small", h("b", "Fix: "), r.suggestion));
    clear(box, parts);
  }
}

function nodeFor(d, { onSelect, label, self = false }) {
  const hc = healthClass(d);
  return h("div.node", {
    class: [self ? "self" : "click", hc ? "bad" : ""].filter(Boolean).join(" "),
    dataset: { seq: d.seq, op: d.op },
    title: self ? null : `Select #${d.seq}`,
    on: self ? {} : { click: () => onSelect(d.seq) },
  },
  h("div.head",
    label ? h("div.sub", label) : null,
    h("div.op", opName(d.op)),
    h("div.sub", `#${d.seq} · step ${d.step} · ${d.phase}${d.module ? ` · ${d.module}` : ""}`),
    h("div", h("span.badge.dtype", outputText(d)), summaryBadges((d.outputs[0] || {}).summary))));
}

function inputNode(inp, onSelect) {
  if (inp.kind === "op") {
    if (inp.producer_digest) return nodeFor(inp.producer_digest, { onSelect, label: `input ${inp.slot}, made by` });
    return h("div.node", h("div.sub", `input ${inp.slot}`), h("div.op", `#${inp.producer}`),
      h("div.sub", "producer evicted by the circular buffer"));
  }
  const what = { param: "parameter", buffer: "buffer", input: "user input / constant" }[inp.kind] || inp.kind;
  const shape = Array.isArray(inp.shape) ? `[${inp.shape.join("×")}]` : "";
  return h("div.node", h("div.sub", `input ${inp.slot}`), h("div.op", inp.name || what),
    h("div.sub", inp.name ? what : shape || ""));
}

export function renderGraph(body, d, { onSelect }) {
  const inputs = d.inputs || [];
  const consumers = d.consumers || [];
  const o = (d.outputs || [])[0] || {};
  const self = nodeFor(d, { onSelect, self: true, label: "selected op" });
  self.id = "graph-selected";
  const kv = h("dl.kv",
    h("dt", "module"), h("dd", d.module ? `${d.module}${d.module_type ? ` (${d.module_type})` : ""}` : "—"),
    h("dt", "output"), h("dd", `${outputText(d)} on ${o.device || "?"}`),
    h("dt", "health"), h("dd", d.health.length ? d.health.join(", ") : "finite"));
  if (d.forward) {
    kv.append(h("dt", "backward of"), h("dd", h("span.link", { on: { click: () => onSelect(d.forward.seq) } },
      `#${d.forward.seq} ${opName(d.forward.op)}`)));
  }
  if ((d.outputs || []).length > 1) {
    d.outputs.slice(1).forEach((out, i) => kv.append(h("dt", `output ${i + 1}`), h("dd", summaryBadges(out.summary))));
  }
  self.append(kv);
  clear(body,
    h("div.g-sec",
      h("div.g-label", `Inputs (${inputs.length})`),
      h("div.g-row.graph-inputs", inputs.length ? inputs.map((i) => inputNode(i, onSelect)) : h("span.muted", "no tensor inputs"))),
    h("div.g-arrow", "↓"),
    h("div.g-sec", h("div.g-label", "Op"), self),
    h("div.g-arrow", "↓"),
    h("div.g-sec",
      h("div.g-label", `Consumers (${consumers.length}${d.more_consumers ? "+" : ""})`),
      h("div.g-row.graph-consumers", consumers.length
        ? consumers.map((c) => nodeFor(c, { onSelect, label: "consumed by" }))
        : h("span.muted", "no recorded op used this output"))));
}
