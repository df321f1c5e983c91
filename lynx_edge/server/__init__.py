"""lynx-edge serve: the OpenAI-compatible HTTP layer (FastAPI) over the engine core; no model logic.

create_app(engine, …) → a FastAPI app; serve(engine, host, port, …) runs it with uvicorn."""
from .app import create_app, serve

__all__ = ["create_app", "serve"]
