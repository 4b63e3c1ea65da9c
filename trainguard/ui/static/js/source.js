// The source pane (the copy of a file stored in the run, one line highlighted) and the stack pane.

import { h, clear, basename } from "./util.js";

// Files longer than this show a window around the line: tens of thousands of DOM rows are slow.
const WINDOW = 1500;
const KEYWORDS = new Set(("False None True and as assert async await break class continue def del elif else except " +
  "finally for from global if import in is lambda nonlocal not or pass raise return try while with yield").split(" "));
const TOKEN = /(#.*$)|("(?:[^"\\]|\\.)*"?|'(?:[^'\\]|\\.)*'?)|\b([A-Za-z_]\w*)\b|\b(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\b/g;

/** One line of Python as spans: comments, strings, keywords, numbers. Text only, never HTML. */
function highlight(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(TOKEN)) {
    let cls = null;
    if (m[1]) cls = "tok-com";
    else if (m[2]) cls = "tok-str";
    else if (m[3]) cls = KEYWORDS.has(m[3]) ? "tok-kw" : null;
    else if (m[4]) cls = "tok-num";
    if (!cls) continue;
    if (m.index > last) out.push(text.slice(last, m.index));
    out.push(h(`span.${cls}`, m[0]));
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}

export class SourcePane {
  constructor(pane, api) {
    this.api = api;
    this.head = pane.querySelector("h2");
    this.code = pane.querySelector(".source-code");
    this.files = new Map();
    this.shown = null;
    this.empty("Select an execution, or a frame in the stack trace, to see its source line.");
  }

  empty(text) {
    clear(this.head, "Source code");
    clear(this.code, h("div.empty", text));
    this.shown = null;
  }

  async show(frame) {
    if (!frame) return this.empty("This execution has no recorded Python stack.");
    if (frame.file_id === null || frame.file_id === undefined) {
      return this.empty(`No copy of ${frame.filename} is stored in this run.`);
    }
    const token = (this.token = {});
    let file = this.files.get(frame.file_id);
    if (!file) {
      try {
        file = await this.api.source(frame.file_id);
      } catch (err) {
        if (token === this.token) this.empty(`The source of ${frame.filename} is not available: ${err.message}`);
        return;
      }
      this.files.set(frame.file_id, file);
    }
    if (token !== this.token) return;
    this.render(file, frame.lineno);
  }

  render(file, lineno) {
    const lines = file.text.split("\n");
    if (lines.length && lines[lines.length - 1] === "") lines.pop();
    clear(this.head,
      h("span.src-head", { title: file.path }, file.path),
      h("span.grow"),
      h("span.count", `line ${lineno}`),
      h("span.small.muted", { style: { textTransform: "none", letterSpacing: 0, fontWeight: 400 } },
        "· copy stored in the run"));
    let lo = 0;
    let hi = lines.length;
    if (lines.length > 2 * WINDOW) {
      lo = Math.max(0, lineno - 1 - WINDOW);
      hi = Math.min(lines.length, lineno - 1 + WINDOW);
    }
    const rows = [];
    if (lo > 0) rows.push(h("div.empty", `… ${lo} earlier lines not shown`));
    for (let i = lo; i < hi; i++) {
      const n = i + 1;
      const cls = n === lineno ? "hl" : Math.abs(n - lineno) <= 2 ? "ctx" : "";
      rows.push(h("div.line", { class: cls, dataset: { line: n } }, h("span.no", n), h("span.code", highlight(lines[i]))));
    }
    if (hi < lines.length) rows.push(h("div.empty", `… ${lines.length - hi} later lines not shown`));
    clear(this.code, rows);
    this.shown = { file_id: file.file_id, lineno };
    const target = this.code.querySelector(".line.hl");
    if (target) this.code.scrollTop = target.offsetTop - this.code.clientHeight / 2 + 9;
  }
}

export class StackPane {
  constructor(pane, { onFrame }) {
    this.head = pane.querySelector("h2");
    this.body = pane.querySelector(".body");
    this.onFrame = onFrame;
    this.showLib = true;
    this.frames = [];
    this.toggle = h("label.stack-opts", h("input", { type: "checkbox", checked: true,
      on: { change: (e) => { this.showLib = e.target.checked; this.render(); } } }), " library frames");
    clear(this.head, "Stack trace", h("span.grow"), this.toggle);
    clear(this.body, h("div.empty", "Select an execution to see the Python stack that ran it."));
  }

  show(frames, userFrame) {
    this.frames = frames || [];
    this.selected = userFrame ? userFrame.frame_id : null;
    this.render();
  }

  render() {
    if (!this.frames.length) {
      clear(this.body, h("div.empty", "No Python stack was recorded for this execution."));
      return;
    }
    const rows = [h("div.small.muted", { style: { padding: "2px 8px" } }, "outermost first; the innermost call is last")];
    for (const f of this.frames) {
      if (!f.user && !this.showLib && f.frame_id !== this.selected) continue;
      const row = h("div.frame", {
        class: [f.user ? "user" : "lib", f.frame_id === this.selected ? "sel" : ""].filter(Boolean).join(" "),
        title: `${f.filename}:${f.lineno}${f.user ? "  (your code)" : ""}`,
        dataset: { frame: f.frame_id, line: f.lineno },
        on: { click: () => { this.selected = f.frame_id; this.render(); this.onFrame(f); } },
      },
      h("span.file", basename(f.filename)),
      h("span.lineno", `line ${f.lineno}`),
      h("span.fn", `${f.name}()${f.user ? "" : "  · library"}`));
      rows.push(row);
    }
    clear(this.body, rows);
    const sel = this.body.querySelector(".frame.sel");
    if (sel) sel.scrollIntoView({ block: "nearest" });
  }
}
