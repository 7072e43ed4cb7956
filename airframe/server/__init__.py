"""The OpenAI-compatible HTTP server behind `airframe serve`.

schemas (request and response bodies), translate (bodies to engine params), queue (one request at a
time on the GPU), metrics (Prometheus text), errors (OpenAI-shaped errors), routes, app.
"""

from .app import ServerOptions, create_app

__all__ = ["ServerOptions", "create_app"]
