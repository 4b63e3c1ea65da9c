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

export function runApi(id) {
  const p = runPath(id);
  return {
    summary: () => api(p),
    alerts: () => api(`${p}/alerts`),
    origin: (seq) => api(`${p}/origin`, { seq }),
    timeline: () => api(`${p}/timeline`),
    executions: (begin, end, filters = {}) => api(`${p}/executions`, { begin, end, ...filters }),
    execution: (seq) => api(`${p}/executions/${seq}`),
    position: (seq, filters = {}) => api(`${p}/executions/${seq}/position`, filters),
    source: (fileId) => api(`${p}/sources/${fileId}`),
    ops: () => api(`${p}/ops`),
    scalars: () => api(`${p}/scalars`),
    layerStats: (kind, stat) => api(`${p}/layer_stats`, { kind, stat }),
    findings: () => api(`${p}/findings`),
    artifacts: () => api(`${p}/artifacts`),
    artifactUrl: (name) => `${p}/artifacts/${name.split("/").map(encodeURIComponent).join("/")}`,
    doctor: () => api(`${p}/doctor`),
    checkpoints: () => api(`${p}/checkpoints`),
    guard: () => api(`${p}/guard`),
  };
}
