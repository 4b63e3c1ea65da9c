// The JSON API client: every call returns parsed JSON or throws an ApiError with the server's message.

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

export async function api(path, params = {}) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, v);
  }
  let response;
  try {
    response = await fetch(url, { headers: { accept: "application/json" } });
  } catch (err) {
    throw new ApiError(0, "NetworkError", "the trainguard server does not answer (stopped?)");
  }
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    body = null;
  }
  if (!response.ok) {
    const e = (body && body.error) || {};
    throw new ApiError(response.status, e.type || "HTTPError", e.message || response.statusText);
  }
  return body;
}

/** URL-safe run id: ids never contain "/", but may contain spaces or ":". */
export const runPath = (id) => `/api/runs/${encodeURIComponent(id)}`;

/** The API of one run; ``rank`` picks one rank of a multi-rank run (null: the server's default). */
export function runApi(id, rank = null) {
  const p = runPath(id);
  const r = rank === null || rank === undefined ? {} : { rank };
  const q = r.rank !== undefined ? `?rank=${r.rank}` : "";
  return {
    summary: () => api(p, r),
    alerts: () => api(`${p}/alerts`, r),
    ranks: () => api(`${p}/ranks`),
    origin: (seq) => api(`${p}/origin`, { seq, ...r }),
    timeline: () => api(`${p}/timeline`, r),
    executions: (begin, end, filters = {}) => api(`${p}/executions`, { begin, end, ...filters, ...r }),
    execution: (seq) => api(`${p}/executions/${seq}`, r),
    position: (seq, filters = {}) => api(`${p}/executions/${seq}/position`, { ...filters, ...r }),
    source: (fileId) => api(`${p}/sources/${fileId}`, r),
    ops: () => api(`${p}/ops`, r),
    scalars: () => api(`${p}/scalars`, r),
    layerStats: (kind, stat) => api(`${p}/layer_stats`, { kind, stat, ...r }),
    findings: () => api(`${p}/findings`, r),
    artifacts: () => api(`${p}/artifacts`, r),
    artifactUrl: (name) => `${p}/artifacts/${name.split("/").map(encodeURIComponent).join("/")}${q}`,
    doctor: () => api(`${p}/doctor`, r),
    checkpoints: () => api(`${p}/checkpoints`, r),
    guard: () => api(`${p}/guard`, r),
  };
}
