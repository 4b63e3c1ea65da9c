// Entry point: the hash router (#/, #/run/ID/debugger[/SEQ], #/run/ID/training, each with ?rank=K
// for one rank of a multi-rank run), the run picker,
// live polling of a run that is still being written, and the pages for missing or damaged runs.

import { api, runApi } from "./api.js";
import { h, clear, fmt, fmtTime } from "./util.js";
import { DebuggerView } from "./debugger.js";
import { TrainingView } from "./training.js";

const POLL_MS = 2000; // a running run's summary is re-read this often
const RUNS_POLL_MS = 5000;

const el = {
  view: document.getElementById("view"),
  picker: document.getElementById("run-picker"),
  status: document.getElementById("run-status"),
  tabs: {
    debugger: document.getElementById("tab-debugger"),
    training: document.getElementById("tab-training"),
  },
};

const state = { runs: [], route: null, view: null, summary: null, poll: null, opening: null };

function parseHash() {
  const [path, query] = window.location.hash.replace(/^#\/?/, "").split("?");
  const parts = path.split("/");
  const rankText = new URLSearchParams(query || "").get("rank");
  const rank = rankText !== null && /^\d+$/.test(rankText) ? Number(rankText) : null;
  if (parts[0] === "run" && parts[1]) {
    const seq = parts[3] !== undefined && parts[3] !== "" ? Number(parts[3]) : null;
    return { runId: decodeURIComponent(parts[1]), view: parts[2] === "training" ? "training" : "debugger", seq, rank };
  }
  return { runId: null, view: "runs", seq: null, rank: null };
}

function hashFor(runId, view, seq, rank = null) {
  const tail = seq !== null && seq !== undefined ? `/${seq}` : "";
  return `#/run/${encodeURIComponent(runId)}/${view}${tail}${rank !== null && rank !== undefined ? `?rank=${rank}` : ""}`;
}

function setStatus(text, cls) {
  if (!text) return clear(el.status);
  clear(el.status, h("span.dot"), text);
  el.status.className = `status ${cls || ""}`;
}

function showError(err) {
  // A failed background request must not wipe the page; say it in the status area.
  setStatus(`error: ${err.message}`, "damaged");
  console.error(err);
}

async function loadRuns() {
  try {
    const data = await api("/api/runs");
    state.runs = data.runs;
    state.logdir = data.logdir;
  } catch (err) {
    showError(err);
  }
  renderPicker();
  return state.runs;
}

function renderPicker() {
  const current = state.route && state.route.runId;
  const options = [h("option", { value: "" }, state.runs.length ? "— all runs —" : "— no runs —")];
  for (const r of state.runs) {
    const ranks = r.ok && r.ranks && r.ranks.length > 1 ? ` (${r.ranks.length} ranks)` : "";
    const label = `${r.path || r.name}${ranks}${r.ok ? (r.status !== "finished" ? ` (${r.status})` : "") : " (damaged)"}`;
    options.push(h("option", { value: r.id, selected: r.id === current }, label));
  }
  if (current && !state.runs.some((r) => r.id === current)) options.push(h("option", { value: current, selected: true }, `${current} (not found)`));
  clear(el.picker, options);
}

el.picker.addEventListener("change", () => {
  const id = el.picker.value;
  const view = state.route && state.route.view !== "runs" ? state.route.view : "debugger";
  window.location.hash = id ? hashFor(id, view) : "#/";
});

function renderTabs() {
  const r = state.route;
  for (const [name, a] of Object.entries(el.tabs)) {
    a.classList.toggle("active", r.view === name);
    a.classList.toggle("disabled", !r.runId);
    if (r.runId) a.href = hashFor(r.runId, name, null, r.rank);
    else a.removeAttribute("href");
  }
}

function runsPage() {
  const rows = state.runs.map((r) => h("tr", { class: r.ok ? "" : "damaged", dataset: { run: r.id } },
    h("td", h("a", { href: hashFor(r.id, "debugger") }, r.path || r.name)),
    h("td", r.ok ? r.status : h("b", { style: { color: "var(--bad)" } }, "damaged")),
    h("td", r.mode || ""),
    h("td.num", r.ok ? fmt(r.executions) : ""),
    h("td.num", r.ok ? (r.nonfinite ? h("b", { style: { color: "var(--nan)" } }, fmt(r.nonfinite)) : "0") : ""),
    h("td", r.ok ? fmtTime(r.created) : ""),
    h("td.wrap", r.ok ? [h("a.link", { href: hashFor(r.id, "debugger") }, "debugger"), " · ", h("a.link", { href: hashFor(r.id, "training") }, "training")]
      : h("span.small", r.error))));
  clear(el.view, h("div.runs#runs",
    h("h1", "Runs"),
    h("p.muted", `${state.runs.length} run${state.runs.length === 1 ? "" : "s"} under ${state.logdir || "the logdir"}. New runs appear here as they are written.`),
    state.runs.length ? h("table.grid",
      h("tr", h("th", "run"), h("th", "status"), h("th", "mode"), h("th.num", "executions"), h("th.num", "non-finite"), h("th", "started"), h("th", "")),
      rows) : h("div.empty", "No trainguard run here yet. Record one with trainguard.record(logdir) or `trainguard run --logdir D script.py`.")));
  document.body.dataset.ready = "runs";
}

function runErrorPage(runId, err) {
  const damaged = err.status === 422;
  clear(el.view, h("div.message#run-error", { dataset: { status: err.status } },
    h("h1", damaged ? `Run “${runId}” is damaged` : err.status === 404 ? `No run “${runId}”` : `Run “${runId}” cannot be shown`),
    h("p", err.message),
    h("p.muted", damaged ? "Its database cannot be read. The other runs are unaffected."
      : "It may have been moved or deleted. The other runs are unaffected."),
    h("p", h("a.link", { href: "#/" }, "Back to all runs"))));
  setStatus(damaged ? "damaged" : "not found", "damaged");
  document.body.dataset.ready = "error";
}

function stopPolling() {
  clearTimeout(state.poll);
  state.poll = null;
}

function schedulePoll() {
  stopPolling();
  if (!state.summary || state.summary.status === "finished") return;
  state.poll = setTimeout(poll, POLL_MS);
}

async function poll() {
  const view = state.view;
  const runId = state.route && state.route.runId;
  if (!view || !runId) return;
  try {
    const s = await runApi(runId, state.route.rank).summary();
    if (view !== state.view) return;
    if (s.revision !== state.summary.revision) {
      state.summary = s;
      renderStatus(s);
      await view.refresh(s);
    }
  } catch (err) {
    showError(err);
  }
  if (view === state.view) schedulePoll();
}

function renderStatus(s) {
  const live = s.status === "running";
  setStatus(`${s.status}${live ? " · live" : ""} · ${s.mode} · ${fmt(s.executions)} executions`, s.status);
}

async function route() {
  const r = parseHash();
  const prev = state.route;
  state.route = r;
  renderTabs();
  renderPicker();
  if (r.view !== "runs" && prev && state.view && prev.runId === r.runId && prev.view === r.view && prev.rank === r.rank) {
    if (r.seq !== null && state.view.select && r.seq !== state.view.seq) state.view.select(r.seq);
    return;
  }
  stopPolling();
  if (state.view) state.view.destroy();
  state.view = null;
  state.summary = null;
  delete document.body.dataset.ready;
  if (r.view === "runs") {
    setStatus("", "");
    await loadRuns();
    runsPage();
    return;
  }
  clear(el.view, h("div.empty", "Opening the run…"));
  let summary;
  try {
    summary = await runApi(r.runId, r.rank).summary();
  } catch (err) {
    runErrorPage(r.runId, err);
    return;
  }
  if (state.route !== r) return;
  state.summary = summary;
  renderStatus(summary);
  const View = r.view === "training" ? TrainingView : DebuggerView;
  const view = new View(el.view, r.runId, summary, {
    onSelect: (seq) => window.history.replaceState(null, "", hashFor(r.runId, r.view, seq, r.rank)),
    error: showError,
    rank: r.rank,
    // Another rank of the same run (replace: the default rank is a choice the page made, not the user).
    goRank: (rank, replace) => {
      const target = hashFor(r.runId, r.view, null, rank);
      if (!replace) {
        window.location.hash = target;
        return;
      }
      window.history.replaceState(null, "", target);
      route();
    },
  });
  state.view = view;
  try {
    await view.mount(r.seq);
  } catch (err) {
    if (err.status === 404 || err.status === 422) runErrorPage(r.runId, err);
    else showError(err);
  }
  schedulePoll();
}

// A logdir of one run opens that run (its training view when it recorded no op), not a list of
// one; the list stays one pick away ("— all runs —"), and "#/" asked for by name keeps it.
function openTheOnlyRun() {
  const runs = state.runs.filter((r) => r.ok);
  if (window.location.hash !== "" || state.runs.length !== 1 || runs.length !== 1) return;
  const [run] = runs;
  window.history.replaceState(null, "", hashFor(run.id, run.executions ? "debugger" : "training"));
}

window.addEventListener("hashchange", route);
loadRuns().then(() => {
  openTheOnlyRun();
  route();
});
setInterval(() => { if (!document.hidden) loadRuns().then(() => { if (state.route && state.route.view === "runs") runsPage(); }); }, RUNS_POLL_MS);
