"""The local web debugger: a read-only JSON API over recorded runs and a static web app.

``create_app(logdir)`` builds the ASGI app; ``serve(logdir, host=..., port=...)`` runs it on
uvicorn, bound to 127.0.0.1 unless told otherwise. Needs the ``ui`` extra (starlette, uvicorn).
"""

from trainguard.ui._app import bind, create_app, serve
from trainguard.ui._openapi import openapi_schema

__all__ = ["bind", "create_app", "openapi_schema", "serve"]
