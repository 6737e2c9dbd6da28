"""The OpenAI-compatible HTTP server over the engine (`kvcodec serve`)."""

from kvcodec.server.app import create_app
from kvcodec.server.run import serve

__all__ = ["create_app", "serve"]
