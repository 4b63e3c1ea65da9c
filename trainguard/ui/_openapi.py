"""The OpenAPI 3.1 description of the JSON API, served at ``/api/openapi.json``.

Written by hand (Starlette generates none); the schemathesis test fuzzes every route against it,
so a response that drifts from this description fails the suite.
"""

from __future__ import annotations

import copy
from typing import Any

from trainguard.store import PHASES

_NUM = {"type": ["number", "string"], "description": "a number, or the string NaN, Infinity, -Infinity"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    props = dict(required)
    props.update(optional or {})
    return {"type": "object", "required": list(required), "properties": props, **extra}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


_SCHEMAS: dict[str, Any] = {
    "Error": _obj(
        {
            "error": _obj(
                {"type": {"type": "string"}, "message": {"type": "string"}, "status": {"type": "integer"}}
            )
        }
    ),
    "Health": _obj({"ok": {"type": "boolean"}, "version": {"type": "string"}}),
    "OpenAPI": _obj({"openapi": {"type": "string"}, "paths": {"type": "object"}}),
    "RunItem": _obj(
        {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "path": {"type": "string"},
            "ok": {"type": "boolean"},
        },
        {
            "status": {"type": "string"},
            "error": {"type": "string"},
            "mode": {"type": "string"},
            "executions": {"type": "integer"},
            "nonfinite": {"type": "integer"},
            "scalars": {"type": "integer"},
            "ranks": _arr({"type": "integer"}),
        },
    ),
    "RunList": _obj({"logdir": {"type": "string"}, "runs": _arr(_ref("RunItem"))}),
    "RunSummary": _obj(
        {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "status": {"type": "string"},
            "mode": {"type": "string"},
            "revision": {"type": "string"},
            "executions": {"type": "integer"},
            "first_seq": _INT_OR_NULL,
            "last_seq": _INT_OR_NULL,
            "steps": {"type": "integer"},
            "nonfinite": {"type": "integer"},
            "has": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "meta": {"type": "object"},
        }
    ),
    "Alerts": _obj(
        {
            "total": {"type": "integer"},
            "first_seq": _INT_OR_NULL,
            "by_op": _arr(
                _obj(
                    {"op": {"type": "string"}, "count": {"type": "integer"}, "first_seq": {"type": "integer"}}
                )
            ),
        },
        {
            "harm_seq": _INT_OR_NULL,
            # Infinities never harmful (masks, sentinels): counted, never alerts.
            "intended": _arr(
                _obj(
                    {"kind": {"type": "string"}, "made_by": _STR_OR_NULL, "absorbed_by": _STR_OR_NULL,
                     "values": {"type": "integer"}, "executions": {"type": "integer"}, "chosen": {"type": "boolean"}}
                )
            ),
            # The gradients of steps a GradScaler skipped (fp16 overflow): counted apart, never alerts.
            "scaler": _obj(
                {"skipped_steps": {"type": "integer"}, "ranges": _arr(_arr({"type": "integer"})),
                 "events": {"type": "integer"}, "first_seq": _INT_OR_NULL,
                 "by_op": _arr(_obj({"op": {"type": "string"}, "count": {"type": "integer"},
                                     "first_seq": {"type": "integer"}}))}
            ),
        },
    ),
    "Origin": _obj(
        {"available": {"type": "boolean"}, "result": {}},
        {"reason": _STR_OR_NULL, "seq": _INT_OR_NULL},
    ),
    "Ranks": _obj({"available": {"type": "boolean"}, "result": {}}, {"reason": _STR_OR_NULL}),
    "Timeline": _obj(
        {
            "total": {"type": "integer"},
            "columns": _arr({"type": "string"}),
            "steps": _arr(_arr({"type": "integer"})),
        }
    ),
    "Output": _obj(
        {"dtype": {}, "shape": {}, "device": {}, "summary": {"type": ["object", "null"]}},
    ),
    "Digest": _obj(
        {
            "seq": {"type": "integer"},
            "step": {"type": "integer"},
            "phase": {"type": "string", "enum": list(PHASES)},
            "op": {"type": "string"},
            "module": _STR_OR_NULL,
            "health": _arr({"type": "string"}),
            "stack_id": _INT_OR_NULL,
            "outputs": _arr(_ref("Output")),
        },
        {"taint": {"type": "string", "enum": ["finite", "unknown", "pending", "harmful"]}, "origin": _INT_OR_NULL},
    ),
    "ExecutionPage": _obj(
        {
            "begin": {"type": "integer"},
            "end": {"type": "integer"},
            "total": {"type": "integer"},
            "items": _arr(_ref("Digest")),
        }
    ),
    "Frame": _obj(
        {
            "frame_id": {"type": "integer"},
            "file_id": _INT_OR_NULL,
            "filename": {"type": "string"},
            "lineno": {"type": "integer"},
            "name": {"type": "string"},
            "user": {"type": "boolean"},
        }
    ),
    "Input": _obj(
        {"slot": {"type": "integer"}, "kind": {"type": "string"}},
        {"producer": {"type": "integer"}, "producer_digest": {"oneOf": [_ref("Digest"), {"type": "null"}]}},
    ),
    "Execution": {
        "allOf": [
            _ref("Digest"),
            _obj(
                {
                    "inputs": _arr(_ref("Input")),
                    "consumers": _arr(_ref("Digest")),
                    "stack": _arr(_ref("Frame")),
                    "user_frame": {"oneOf": [_ref("Frame"), {"type": "null"}]},
                    "index": {"type": "integer"},
                }
            ),
        ]
    },
    "Position": _obj({"seq": {"type": "integer"}, "index": {"type": "integer"}}),
    "Stack": _obj({"stack_id": {"type": "integer"}, "frames": _arr(_ref("Frame"))}),
    "SourceList": _obj(
        {
            "files": _arr(
                _obj(
                    {
                        "file_id": {"type": "integer"},
                        "path": {"type": "string"},
                        "user": {"type": "boolean"},
                        "available": {"type": "integer"},
                    }
                )
            )
        }
    ),
    "Source": _obj(
        {
            "file_id": {"type": "integer"},
            "path": {"type": "string"},
            "user": {"type": "boolean"},
            "text": {"type": "string"},
            "lines": {"type": "integer"},
        }
    ),
    "Ops": _obj({"ops": _arr(_obj({"op": {"type": "string"}, "count": {"type": "integer"}}))}),
    "Scalars": _obj(
        {
            "names": _arr({"type": "string"}),
            "series": {
                "type": "object",
                "additionalProperties": _obj(
                    {
                        "points": _arr(_arr(_NUM)),
                        "count": {"type": "integer"},
                        "nonfinite": {"type": "integer"},
                    }
                ),
            },
        }
    ),
    "LayerStats": _obj(
        {
            "available": _arr(_arr({"type": "string"})),
            "kind": _STR_OR_NULL,
            "stat": _STR_OR_NULL,
            "layers": _arr({"type": "string"}),
            "steps": _arr({"type": "integer"}),
            "values": _arr(_arr({"type": ["number", "string", "null"]})),
        }
    ),
    "Findings": _obj(
        {
            "findings": _arr(
                _obj(
                    {"kind": {"type": "string"}, "severity": {"type": "string"}, "title": {"type": "string"}},
                    {
                        "evidence": {},
                        "suggestion": {},
                        "steps": {},
                        "layers": {},
                        "origin": {"type": "string"},
                    },
                )
            ),
            "verdict": _obj(
                {"state": {"type": "string"}, "text": {"type": "string"}, "problems": {"type": "integer"}}
            ),
            "diagnosis": _obj({"available": {"type": "boolean"}}),
        }
    ),
    "Artifacts": _obj(
        {
            "artifacts": _arr(
                _obj(
                    {
                        "name": {"type": "string"},
                        "media_type": {"type": "string"},
                        "size": {"type": "integer"},
                        "stored": {"type": "string", "enum": ["database", "file"]},
                    }
                )
            )
        }
    ),
    "Doctor": _obj(
        {
            "report": {},
            "lr_range": {"oneOf": [{"type": "null"}, _obj({"lr": _arr(_NUM), "loss": _arr(_arr(_NUM))})]},
            "lr_suggestion": {"type": ["number", "null"]},
            "lr_plot": _STR_OR_NULL,
        }
    ),
    "Checkpoints": _obj(
        {"available": {"type": "boolean"}, "reason": _STR_OR_NULL, "checkpoints": _arr({"type": "object"})}
    ),
    "Guard": _obj(
        {
            "available": {"type": "boolean"},
            "meta": {"type": ["object", "null"]},
            "events": _arr(_obj({"step": {"type": "integer"}, "action": {"type": "string"},
                                 "message": {"type": "string"}, "replay_run_id": _STR_OR_NULL})),
        }
    ),
}

_ERRORS = {
    "400": ("a parameter has a value the API does not accept", "Error"),
    "403": ("the path leaves the run directory or goes through a symlink", "Error"),
    "404": ("no such run, execution, stack, source file or artifact", "Error"),
    "422": ("the run is damaged or was written by a newer trainguard", "Error"),
}


def _p(name: str, where: str, schema: dict[str, Any], desc: str, required: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": required or where == "path",
        "schema": schema,
        "description": desc,
    }


# "/"-separated parts that do not start with a dot: no "." or "..", no backslash, "%" or NUL.
_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_. -]*(/[A-Za-z0-9_-][A-Za-z0-9_. -]*)*$"
# SQLite integers are 64-bit; the server answers 400 beyond this.
_UINT = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
_RUN = _p("run", "path", {"type": "string", "minLength": 1}, "run id, as listed by /api/runs")
_RANK = _p(
    "rank", "query", _UINT, "rank of a multi-process run (default: lowest)"
)
_FILTERS = [
    _p("step", "query", {"type": "string", "pattern": "^[0-9]{1,18}(:[0-9]{1,18})?$"}, "one step N, or a range A:B"),
    _p("op", "query", {"type": "string"}, "op name, e.g. log or aten.log.default"),
    _p("module", "query", {"type": "string"}, "module path; includes its children"),
    _p("phase", "query", {"type": "string", "enum": list(PHASES)}, "forward, backward, optimizer, other"),
    _p(
        "health",
        "query",
        {"type": "string", "enum": ["nonfinite", "bad", "nan", "inf", "+inf", "-inf", "ok", "finite", "harmful",
                                    "pending", "unknown"]},
        "keep executions by output health, or by taint (harmful, pending, unknown)",
    ),
]


def _get(
    summary: str, schema: str | None, params: list[dict[str, Any]], media: str = "application/json"
) -> dict:
    ok: dict[str, Any] = {"description": "OK"}
    if schema is not None:
        ok["content"] = {media: {"schema": _ref(schema)}}
    else:
        ok["content"] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    responses = {"200": ok}
    if params:
        responses.update(
            {
                code: {"description": d, "content": {"application/json": {"schema": _ref(s)}}}
                for code, (d, s) in _ERRORS.items()
            }
        )
    return {"get": {"summary": summary, "parameters": params, "responses": responses}}


_PATHS = {
    "/api/health": _get("Server is up; trainguard version", "Health", []),
    "/api/openapi.json": _get("This description of the API (OpenAPI 3.1)", "OpenAPI", []),
    "/api/runs": _get("Runs found under the logdir (damaged ones say why)", "RunList", []),
    "/api/runs/{run}": _get(
        "One run: status, counts, what it holds, a revision for live polling", "RunSummary", [_RUN, _RANK]
    ),
    "/api/runs/{run}/alerts": _get(
        "Non-finite events counted by op type, with the first of each", "Alerts", [_RUN, _RANK]
    ),
    "/api/runs/{run}/ranks": _get(
        "A run of several ranks: every rank's alerts, which rank made the first non-finite value and which "
        "only received it (from trainguard.analysis)",
        "Ranks",
        [_RUN],
    ),
    "/api/runs/{run}/origin": _get(
        "How the first (or the given) non-finite value was made, from trainguard.analysis",
        "Origin",
        [_RUN, _p("seq", "query", _UINT, "a non-finite execution (default: the first)"), _RANK],
    ),
    "/api/runs/{run}/timeline": _get(
        "Per step: first and last seq, count, non-finite count", "Timeline", [_RUN, _RANK]
    ),
    "/api/runs/{run}/executions": _get(
        "Execution digests, rows begin:end of the filtered list (at most 1000)",
        "ExecutionPage",
        [
            _RUN,
            _p("begin", "query", _UINT, "first row"),
            _p("end", "query", _UINT, "row after the last"),
            *_FILTERS,
            _RANK,
        ],
    ),
    "/api/runs/{run}/executions/{seq}": _get(
        "One execution in full: inputs with producers, consumers, stack, user frame, row index",
        "Execution",
        [_RUN, _p("seq", "path", _UINT, "sequence number"), _RANK],
    ),
    "/api/runs/{run}/executions/{seq}/position": _get(
        "Row of an execution in the filtered list",
        "Position",
        [_RUN, _p("seq", "path", _UINT, "sequence number"), *_FILTERS, _RANK],
    ),
    "/api/runs/{run}/stacks/{stack_id}": _get(
        "Frames of a stack, outermost first",
        "Stack",
        [_RUN, _p("stack_id", "path", _UINT, "stack id"), _RANK],
    ),
    "/api/runs/{run}/sources": _get("Source files stored in the run", "SourceList", [_RUN, _RANK]),
    "/api/runs/{run}/sources/{file_id}": _get(
        "A source file's text as stored when the run was recorded (never read from disk)",
        "Source",
        [_RUN, _p("file_id", "path", _UINT, "file id"), _RANK],
    ),
    "/api/runs/{run}/ops": _get("Executions counted by op type", "Ops", [_RUN, _RANK]),
    "/api/runs/{run}/scalars": _get(
        "Per-step scalars (loss, lr/N, grad_norm, ...); long series reduced to min/max per bucket",
        "Scalars",
        [_RUN, _p("max_points", "query", dict(_UINT, minimum=10), "points per series"), _RANK],
    ),
    "/api/runs/{run}/layer_stats": _get(
        "A layer x step matrix of one statistic, and the statistics the run has",
        "LayerStats",
        [
            _RUN,
            _p("kind", "query", {"type": "string"}, "activation, gradient, weight, update"),
            _p("stat", "query", {"type": "string"}, "e.g. mean, std, zero_frac, norm"),
            _RANK,
        ],
    ),
    "/api/runs/{run}/findings": _get(
        "Findings with evidence and suggestions, and a verdict", "Findings", [_RUN, _RANK]
    ),
    "/api/runs/{run}/artifacts": _get(
        "Stored results: doctor report, plots, CSV", "Artifacts", [_RUN, _RANK]
    ),
    "/api/runs/{run}/artifacts/{name}": _get(
        "One artifact's bytes (database first, then a plain file inside the run directory)",
        None,
        [_RUN, _p("name", "path", {"type": "string", "pattern": _NAME}, "artifact name, e.g. doctor/lr_range_test.png"), _RANK],
    ),
    "/api/runs/{run}/doctor": _get("Doctor report and LR range test curve", "Doctor", [_RUN, _RANK]),
    "/api/runs/{run}/checkpoints": _get(
        "Checkpoints in the run's checkpoints/ folder", "Checkpoints", [_RUN, _RANK]
    ),
    "/api/runs/{run}/guard": _get(
        "The guard's events: each rewind with its replay, origin chain and skipped batches", "Guard", [_RUN, _RANK]
    ),
}


def openapi_schema() -> dict[str, Any]:
    from trainguard import __version__

    return copy.deepcopy(
        {
            "openapi": "3.1.0",
            "info": {
                "title": "trainguard UI API",
                "version": __version__,
                "description": "Read-only JSON over recorded runs. Errors: {error: {type, message, status}}. "
                "Non-finite numbers are the strings NaN, Infinity, -Infinity.",
            },
            "paths": _PATHS,
            "components": {"schemas": _SCHEMAS},
        }
    )
