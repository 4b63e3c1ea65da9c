"""HTTP routes: each maps one URL onto one provider function. No data logic lives here."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trainguard.ui import _provider as data
from trainguard.ui import _training as training
from trainguard.ui._openapi import openapi_schema
from trainguard.ui._registry import BadRequest, Registry

_FILTER_PARAMS = ("step", "op", "module", "phase", "health")
# SQLite integers are 64-bit: a larger number can name nothing and must not reach the database.
MAX_INT = 2**63 - 1


def _int(request: Request, name: str, default: int | None = None, *, minimum: int | None = 0) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise BadRequest(f"{name} must be <= {MAX_INT}, got {value}")
    return value


def _path_int(request: Request, name: str) -> int:
    raw = request.path_params[name]
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from None
    if not 0 <= value <= MAX_INT:
        raise BadRequest(f"{name} must be between 0 and {MAX_INT}, got {value}")
    return value


def _filters(request: Request) -> dict[str, Any]:
    return {k: request.query_params[k] for k in _FILTER_PARAMS if request.query_params.get(k)}


def _json(fn: Callable[[Registry, Request], Any]) -> Callable:
    """An endpoint that runs ``fn`` off the event loop (SQLite reads block) and answers JSON."""

    async def endpoint(request: Request) -> Response:
        reg: Registry = request.app.state.registry
        result = await run_in_threadpool(fn, reg, request)
        if isinstance(result, Response):
            return result
        return JSONResponse(result)

    endpoint.__name__ = fn.__name__
    return endpoint


def _run(request: Request) -> str:
    return request.path_params["run"]


def _rank(request: Request) -> int | None:
    return _int(request, "rank", None)


def health(reg: Registry, request: Request) -> dict:
    from trainguard import __version__

    return {"ok": True, "version": __version__}


def runs(reg: Registry, request: Request) -> dict:
    return data.list_runs(reg)


def run_summary(reg: Registry, request: Request) -> dict:
    return data.summary(reg, _run(request), _rank(request))


def alerts(reg: Registry, request: Request) -> dict:
    return data.alerts(reg, _run(request), _rank(request))


def ranks(reg: Registry, request: Request) -> dict:
    return data.ranks(reg, _run(request))


def origin(reg: Registry, request: Request) -> dict:
    return data.origin(reg, _run(request), _int(request, "seq"), _rank(request))


def timeline(reg: Registry, request: Request) -> dict:
    return data.timeline(reg, _run(request), _rank(request))


def executions(reg: Registry, request: Request) -> dict:
    begin = _int(request, "begin", 0)
    end = _int(request, "end", begin + 100)
    return data.executions(reg, _run(request), begin, end, _rank(request), **_filters(request))


def execution(reg: Registry, request: Request) -> dict:
    return data.execution(reg, _run(request), _path_int(request, "seq"), _rank(request))


def position(reg: Registry, request: Request) -> dict:
    return data.position(reg, _run(request), _path_int(request, "seq"), _rank(request), **_filters(request))


def stack(reg: Registry, request: Request) -> dict:
    return data.stack(reg, _run(request), _path_int(request, "stack_id"), _rank(request))


def sources(reg: Registry, request: Request) -> dict:
    return data.sources(reg, _run(request), _rank(request))


def source(reg: Registry, request: Request) -> dict:
    return data.source(reg, _run(request), _path_int(request, "file_id"), _rank(request))


def ops(reg: Registry, request: Request) -> dict:
    return data.ops(reg, _run(request), _rank(request))


def scalars(reg: Registry, request: Request) -> dict:
    max_points = _int(request, "max_points", training.MAX_POINTS, minimum=10)
    return training.scalars(reg, _run(request), _rank(request), max_points=max_points)


def layer_stats(reg: Registry, request: Request) -> dict:
    q = request.query_params
    return training.layer_stats(
        reg, _run(request), q.get("kind") or None, q.get("stat") or None, _rank(request)
    )


def findings(reg: Registry, request: Request) -> dict:
    return training.findings(reg, _run(request), _rank(request))


def artifacts(reg: Registry, request: Request) -> dict:
    return training.artifacts(reg, _run(request), _rank(request))


# The media types the UI itself writes and shows, and how each is served. A run may hold an
# artifact of any type (stored with it, or a file beside the database): anything else is served
# as bytes to save, never as something the browser renders or runs in the app's origin.
_SERVED_AS = {"image/png": "inline", "text/plain": "inline", "application/json": "attachment", "text/csv": "attachment"}


def artifact(reg: Registry, request: Request) -> Response:
    name = request.path_params["name"]
    media, body = training.artifact(reg, _run(request), name, _rank(request))
    media = media.split(";")[0].strip().lower()
    disposition = _SERVED_AS.get(media)
    if disposition is None:
        media, disposition = "application/octet-stream", "attachment"
    filename = re.sub(r"[^A-Za-z0-9._-]", "_", name.rsplit("/", 1)[-1]) or "artifact"
    return Response(body, media_type=media, headers={"Content-Disposition": f'{disposition}; filename="{filename}"',
                                                     "X-Content-Type-Options": "nosniff"})


def doctor(reg: Registry, request: Request) -> dict:
    return training.doctor(reg, _run(request), _rank(request))


def checkpoints(reg: Registry, request: Request) -> dict:
    return training.checkpoints(reg, _run(request), _rank(request))


def guard(reg: Registry, request: Request) -> dict:
    return training.guard(reg, _run(request), _rank(request))


def openapi(reg: Registry, request: Request) -> dict:
    return openapi_schema()


ROUTES = [
    Route("/api/health", _json(health)),
    Route("/api/openapi.json", _json(openapi)),
    Route("/api/runs", _json(runs)),
    Route("/api/runs/{run}", _json(run_summary)),
    Route("/api/runs/{run}/alerts", _json(alerts)),
    Route("/api/runs/{run}/ranks", _json(ranks)),
    Route("/api/runs/{run}/origin", _json(origin)),
    Route("/api/runs/{run}/timeline", _json(timeline)),
    Route("/api/runs/{run}/executions", _json(executions)),
    Route("/api/runs/{run}/executions/{seq}", _json(execution)),
    Route("/api/runs/{run}/executions/{seq}/position", _json(position)),
    Route("/api/runs/{run}/stacks/{stack_id}", _json(stack)),
    Route("/api/runs/{run}/sources", _json(sources)),
    Route("/api/runs/{run}/sources/{file_id}", _json(source)),
    Route("/api/runs/{run}/ops", _json(ops)),
    Route("/api/runs/{run}/scalars", _json(scalars)),
    Route("/api/runs/{run}/layer_stats", _json(layer_stats)),
    Route("/api/runs/{run}/findings", _json(findings)),
    Route("/api/runs/{run}/artifacts", _json(artifacts)),
    Route("/api/runs/{run}/artifacts/{name:path}", _json(artifact)),
    Route("/api/runs/{run}/doctor", _json(doctor)),
    Route("/api/runs/{run}/checkpoints", _json(checkpoints)),
    Route("/api/runs/{run}/guard", _json(guard)),
]
