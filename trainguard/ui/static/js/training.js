// The training view: loss curve and verdict, the guard's rewinds, other per-step scalars, the
// per-layer heatmap, findings, the doctor's LR range test and the checkpoints. Each card says
// plainly when the run holds nothing for it.

import { h, clear, fmt, fmtBytes, fmtTime, num, debounce } from "./util.js";
import { runApi } from "./api.js";
import { heatmap, lineChart } from "./charts.js";

function card(cls, title, ...extra) {
  const content = h("div.content");
  const node = h(`section.card.${cls}`, h("h2", title, h("span.grow"), ...extra), content);
  node.content = content;
  return node;
}

/** Evidence values: numbers formatted (NaN/Inf included), anything else as written. */
function showValue(val) {
  if (Array.isArray(val)) return val.map((v) => (v !== null && typeof v === "object" ? JSON.stringify(v) : showValue(v))).join(", ");
  if (val !== null && typeof val === "object") {
    return Object.entries(val).map(([k, v]) => `${k}: ${v !== null && typeof v === "object" ? JSON.stringify(v) : showValue(v)}`).join(" · ");
  }
  if (typeof val === "number" || /^-?(NaN|Infinity)$/.test(String(val))) return fmt(val);
  return String(val);
}

function empty(text) {
  return h("div.empty", text);
}

const STOPPED = new Set(["stop", "code_bug", "max_rewinds"]);

function where(link) {
  return link.file ? `${link.file.split("/").slice(-2).join("/")}:${link.line}` : "(no user frame)";
}

/** A skipped batch's samples, those whose rows hold the origin's first non-finite values marked. */
function samplesCell(e, samples) {
  if (!samples) return "the loader does not say";
  const c = e.culprits || {};
  const rows = new Map((c.samples || []).map((s, i) => [s, c.rows[i]]));
  const kind = e.origin && e.origin.origin.health.includes("nan") ? "nan" : "inf";
  return samples.flatMap((s, i) => [i ? ", " : "", rows.has(s)
    ? h("b.culprit", { title: `the first ${kind} is in this sample's row (${rows.get(s)} of ${c.size})` }, String(s))
    : String(s)]);
}

/** What the guard handled without a rewind: batches skipped unread because an event found their
 *  samples corrupt, steps the loop skipped itself (a non-finite loss it never backpropagated), and
 *  ops that raised in an evaluation under no_grad inside the loop (eval_faults). */
function guardNotes(m) {
  const notes = [];
  const known = Number.isInteger(m.skipped_known) ? m.skipped_known : 0;
  const repeat = Number.isInteger(m.skipped_repeat) ? m.skipped_repeat : 0;
  const last = m.last_skipped_known || {};
  for (const [n, why, what] of [[known - repeat, "data", "an event found corrupt in the batch itself"],
    [repeat, "repeat", "two events blamed for the same fault"]]) {
    if (n <= 0) continue;
    notes.push(h(`div.guard-note.skipped-${why === "data" ? "known" : "repeat"}`, `${n} later batch${n === 1 ? "" : "es"} `
      + `held a sample ${what}, and ${n === 1 ? "was" : "were"} skipped unread (no rewind)`
      + (Number.isInteger(last.step) && (last.why || "data") === why ? `; the last at step ${fmt(last.step)} (epoch ${last.epoch})` : "")));
  }
  const loop = m.loop_skipped;
  if (loop && loop.count > 0) {
    const first = loop.first || {};
    const value = { NaN: "nan", Infinity: "inf", "-Infinity": "-inf" }[first.loss] || "?";
    const at = first.file ? ` (checked at ${where(first)})` : "";
    notes.push(h("div.guard-note.loop-skipped", `the loop skipped ${loop.count} step${loop.count === 1 ? "" : "s"} itself, `
      + `the first at step ${fmt(first.step)}: its loss was ${value}${at} and it called no backward(), so nothing was `
      + "updated and the guard did not rewind; find where the NaN/Inf comes from with `trainguard run --check-numerics`"));
  }
  const ev = m.eval_faults;
  if (ev && ev.count > 0) {
    const first = (ev.first || {}).message || "";
    const last = ev.count > 1 && ev.last && Number.isInteger(ev.last.step) ? `; the last at step ${fmt(ev.last.step)}` : "";
    notes.push(h("div.guard-note.eval-faults", `${ev.count} evaluation fault${ev.count === 1 ? "" : "s"} (no rewind), `
      + `the first: ${first}${last}; repair or drop that sample of the evaluation's data`));
  }
  return notes;
}

/** One rewind: what failed, the replay, the origin chain, the skipped batches, what followed. */
function guardEvent(e) {
  const rp = e.replay || {};
  const replay = [`rewound to step ${fmt(e.rewound_to)} (${e.rewound_from})`];
  if (rp.steps) replay.push(`replayed ${rp.steps} step${rp.steps === 1 ? "" : "s"}`);
  if (rp.bitwise_equal === true) replay.push("losses bitwise equal");
  if (rp.bitwise_equal === false) replay.push(`losses differ from step ${rp.mismatch.step}`);
  if (rp.reproduced === false) replay.push("the fault did not reproduce");
  const o = e.origin;
  const skipped = e.skipped || [];
  return h("div.guard-event", { dataset: { step: e.step, action: e.action } },
    h("div", h("span.sev", { class: STOPPED.has(e.action) ? "error" : "warning" }, STOPPED.has(e.action) ? "stopped" : e.action),
      h("span.title", `step ${fmt(e.step)}: ${e.reason}`)),
    e.replay ? h("div.where", replay.join(" · "),
      e.replay_run_id ? [" · ", h("a.link.replay-link", { href: `#/run/${encodeURIComponent(e.replay_run_id)}/debugger` },
        "open the replayed step in the debugger")] : null) : null,
    o ? h("div.origin", h("b", "origin: "), h("code", `${o.origin.op} at ${where(o.origin)}`), ` — ${o.origin.explanation}`) : null,
    o && o.chain.length > 1 ? h("ol.chain", o.chain.map((c) => h("li", h("code", `#${c.seq} ${c.op} at ${where(c)}`), ` ${c.explanation}`))) : null,
    skipped.length ? h("table.grid.skipped",
      h("tr", h("th", "skipped batch"), h("th", "epoch"), h("th", "index"), h("th", "samples")),
      skipped.map((b) => h("tr", h("td", fmt(b.batch)), h("td", fmt(b.epoch)), h("td", fmt(b.index)),
        h("td.wrap", samplesCell(e, b.samples))))) : null,
    h("div.outcome", e.outcome),
    o && o.suggestion ? h("div.fix", h("b", "Suggested fix: "), o.suggestion) : null);
}

export class TrainingView {
  constructor(root, runId, summary, hooks) {
    this.root = root;
    this.runId = runId;
    this.summary = summary;
    this.hooks = hooks;
    this.api = runApi(runId, hooks.rank);
    this.stat = null;
  }

  async mount() {
    this.verdict = h("div.verdict#verdict", "Reading the run…");
    this.loss = card("c-loss", "Loss");
    this.scalars = card("c-scalars", "Learning rate and other scalars");
    this.statPick = h("select", { title: "Statistic", on: { change: (e) => this.loadLayers(e.target.value) } });
    this.layers = card("c-layers", "Per-layer statistics over steps", this.statPick);
    this.findings = card("c-findings", "Findings");
    this.lr = card("c-lr", "Learning-rate range test");
    this.ckpt = card("c-ckpt", "Checkpoints");
    this.guard = card("c-guard", "Guard: rewinds and replays");
    clear(this.root, h("div.training#training", this.verdict, this.guard, this.loss, this.scalars,
      h("div.col-left", this.layers, this.lr, this.ckpt), this.findings));
    this.resize = new ResizeObserver(debounce(() => this.redraw(), 150));
    this.resize.observe(this.root);
    await Promise.all([this.loadScalars(), this.loadLayers(), this.loadFindings(), this.loadDoctor(), this.loadCheckpoints(),
      this.loadGuard()]
      .map((p) => p.catch((err) => this.hooks.error(err))));
    document.body.dataset.ready = "training";
    performance.mark("trainguard:training-ready"); // read by benchmarks/bench_ui.py
  }

  destroy() {
    if (this.resize) this.resize.disconnect();
  }

  async refresh(summary) {
    this.summary = summary;
    await Promise.all([this.loadScalars(), this.loadLayers(this.stat), this.loadFindings(), this.loadCheckpoints(), this.loadGuard()]
      .map((p) => p.catch((err) => this.hooks.error(err))));
  }

  redraw() {
    if (this.scalarData) this.drawScalars();
    if (this.layerData) this.drawLayers();
    if (this.lrData) this.drawLr();
  }

  async loadScalars() {
    this.scalarData = await this.api.scalars();
    this.drawScalars();
  }

  lossName() {
    const names = this.scalarData.names;
    return names.includes("loss") ? "loss" : names.find((n) => /loss/i.test(n)) || null;
  }

  drawScalars() {
    const data = this.scalarData;
    const lossName = this.lossName();
    if (!lossName) {
      clear(this.loss.content, empty("No loss was recorded in this run. Record one with trainguard.Monitor or `trainguard run --monitor`."));
    } else {
      const se = data.series[lossName];
      const w = this.loss.content.clientWidth - 20;
      const chart = lineChart([{ name: lossName, points: se.points }], { width: w, height: 260 });
      chart.id = "loss-chart";
      const first = se.points.find(([, v]) => !Number.isFinite(num(v)));
      const last = [...se.points].reverse().find(([, v]) => Number.isFinite(num(v)));
      clear(this.loss.content, chart, h("div.small.muted",
        `${fmt(se.count)} steps`, last ? ` · last finite ${lossName} ${fmt(last[1])} at step ${fmt(last[0])}` : "",
        first ? h("b", { style: { color: "var(--nan)" } }, ` · ${lossName} is ${fmt(first[1])} from step ${fmt(first[0])}`) : ""));
    }
    const others = data.names.filter((n) => n !== lossName);
    if (!others.length) {
      clear(this.scalars.content, empty("No other per-step scalars (learning rate, gradient norm) in this run."));
      return;
    }
    // learning rates first: the LR schedule is what this card is read for
    others.sort((a, b) => (b.startsWith("lr") - a.startsWith("lr")) || a.localeCompare(b));
    const w = this.scalars.content.clientWidth - 20;
    clear(this.scalars.content, others.map((name) => {
      const se = data.series[name];
      const vals = se.points.map(([, v]) => num(v)).filter((v) => Number.isFinite(v));
      const logY = vals.length > 1 && vals.every((v) => v > 0) && Math.max(...vals) / Math.min(...vals) > 50;
      return h("div.small-multiple", { dataset: { scalar: name } },
        h("div.t", h("span", name), h("span", vals.length ? `last ${fmt(vals[vals.length - 1])}` : "")),
        lineChart([{ name, points: se.points, cls: "s2" }], { width: w, height: 110, logY }));
    }));
  }

  async loadLayers(value) {
    let kind = null;
    let stat = null;
    if (value) [kind, stat] = value.split("/");
    const data = await this.api.layerStats(kind, stat);
    this.layerData = data;
    this.stat = data.kind ? `${data.kind}/${data.stat}` : null;
    clear(this.statPick, data.available.map(([k, s]) => h("option", { value: `${k}/${s}`, selected: `${k}/${s}` === this.stat }, `${k} · ${s}`)));
    this.statPick.style.display = data.available.length ? "" : "none";
    this.drawLayers();
  }

  drawLayers() {
    const data = this.layerData;
    if (!data.layers.length) {
      clear(this.layers.content, empty("No per-layer statistics in this run. trainguard.Monitor(model, logdir=...) records activations and gradients per layer."));
      return;
    }
    const map = heatmap(data, this.layers.content.clientWidth - 20);
    map.id = "layer-heatmap";
    clear(this.layers.content, map);
  }

  async loadFindings() {
    const data = await this.api.findings();
    const v = data.verdict;
    const label = { healthy: "healthy", warning: "warning", error: "error", critical: "critical", unknown: "no verdict", none: "no data" }[v.state] || v.state;
    clear(this.verdict, h("span.sev", { class: v.state }, label), h("span", v.text),
      data.diagnosis.available ? null : h("span.small.muted", `(live diagnosis unavailable: ${data.diagnosis.reason})`));
    this.verdict.className = `verdict ${v.state}`;
    if (!data.findings.length) {
      clear(this.findings.content, empty("No findings stored in this run."));
      return;
    }
    clear(this.findings.content, data.findings.map((f) => {
      const ev = f.evidence && typeof f.evidence === "object" ? Object.entries(f.evidence) : [];
      const steps = Array.isArray(f.steps) ? `steps ${f.steps[0]}–${f.steps[1]}` : "";
      const layers = Array.isArray(f.layers) && f.layers.length ? `layers ${f.layers.join(", ")}` : "";
      return h("div.finding", { dataset: { kind: f.kind } },
        h("div", h("span.sev", { class: f.severity }, f.severity), h("span.title", f.title || f.kind)),
        h("div.where", [f.kind, steps, layers, f.source].filter(Boolean).join(" · ")),
        ev.length ? h("dl.kv", ev.flatMap(([k, val]) => [h("dt", k), h("dd", showValue(val))])) : null,
        f.suggestion ? h("div.fix", h("b", "Suggested fix: "), f.suggestion) : null,
        // the findings this one explains (causes over symptoms), folded under it
        Array.isArray(f.symptoms) && f.symptoms.length ? h("div.symptoms", h("div.small.muted", "Explains:"),
          f.symptoms.map((s) => h("div.symptom", { dataset: { kind: s.kind } },
            h("span.sev", { class: s.severity }, s.severity), h("span.title", s.title || s.kind)))) : null);
    }));
  }

  async loadDoctor() {
    this.lrData = await this.api.doctor();
    this.drawLr();
  }

  drawLr() {
    const d = this.lrData;
    const parts = [];
    if (d.lr_range) {
      const series = d.lr_range.loss.map((ys, i) => ({ name: d.lr_range.columns[i], points: d.lr_range.lr.map((x, j) => [x, ys[j]]) }));
      const marks = d.lr_suggestion !== null ? [{ x: d.lr_suggestion, label: `suggested ${fmt(d.lr_suggestion)}` }] : [];
      const chart = lineChart(series, { width: this.lr.content.clientWidth - 20, height: 220, logX: true, marks, xName: "lr", xLabel: "learning rate (log)" });
      chart.id = "lr-range-chart";
      parts.push(chart);
    }
    if (d.lr_plot && !d.lr_range) {
      parts.push(h("img.lr-plot", { src: this.api.artifactUrl(d.lr_plot), alt: "LR range test plot written by the doctor" }));
    } else if (d.lr_plot) {
      parts.push(h("div.small", h("a.link#lr-plot-link", { href: this.api.artifactUrl(d.lr_plot), target: "_blank", rel: "noopener" },
        "the doctor's plot (PNG)")));
    }
    if (!parts.length) {
      parts.push(empty("No learning-rate range test in this run. `trainguard doctor module:function --logdir RUN` writes one."));
    } else if (d.lr_suggestion !== null) {
      parts.unshift(h("div", "Suggested learning rate: ", h("b", fmt(d.lr_suggestion))));
    }
    clear(this.lr.content, parts);
  }

  async loadGuard() {
    const d = await this.api.guard();
    if (!d.available) {
      clear(this.guard.content, empty("No guard watched this run. tg.Guard(logdir) with ckpt.resume(..., guard=guard) and loop.batches(), or `trainguard run --guard script.py`, rewinds and replays a step that goes NaN."));
      return;
    }
    const m = d.meta || {};
    const head = h("div.small.muted", [`policy ${m.policy}`, `a snapshot every ${m.snapshot_every} steps`,
      m.snapshot_bytes ? `${fmtBytes(m.snapshot_bytes)} of host memory` : null,
      m.spike_factor ? `spike factor ${m.spike_factor}` : null, `status ${m.status}`].filter(Boolean).join(" · "));
    const notes = guardNotes(m);
    if (!d.events.length) {
      clear(this.guard.content, head, notes, notes.length ? null
        : empty("The guard saw no NaN, Inf or spike: nothing was rewound."));
      return;
    }
    clear(this.guard.content, head, notes, d.events.map((e) => guardEvent(e)));
  }

  async loadCheckpoints() {
    const d = await this.api.checkpoints();
    if (!d.available) {
      clear(this.ckpt.content, empty(`No checkpoints to show: ${d.reason}.`));
      return;
    }
    if (!d.checkpoints.length) {
      clear(this.ckpt.content, empty("The checkpoints/ folder holds no checkpoint yet."));
      return;
    }
    clear(this.ckpt.content, h("table.grid#checkpoints",
      h("tr", h("th", "step"), h("th", "saved"), h("th.num", "size"), h("th", "state")),
      d.checkpoints.map((c) => h("tr", { class: c.valid ? "" : "damaged" },
        h("td", fmt(c.step)), h("td", fmtTime(c.time)), h("td.num", fmtBytes(c.size)),
        h("td.wrap", c.valid ? h("span", { style: { color: "var(--good)" } }, "valid") : h("span", { style: { color: "var(--bad)" } }, c.reason || "invalid"))))));
  }
}
