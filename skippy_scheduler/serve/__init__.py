"""An OpenAI-compatible HTTP server on the engine: continuous batching on llama.cpp.

`skippy-scheduler serve` runs it (`pip install 'skippy-scheduler[serve]'`). The pieces:

* `server`: `ServeSettings` and `Server` (model, host, scheduler, engine thread, uvicorn);
* `runner`: the engine on its own thread, one event subscription per request;
* `app`: FastAPI routes, request translation, SSE streaming, disconnect handling;
* `protocol`: OpenAI request bodies to generation requests (400s that name the field);
* `text`: incremental UTF-8-safe detokenisation and stop strings;
* `chat`: chat templates through llama.cpp; `metrics`: Prometheus; `errors`: error bodies.
"""
from .server import POLICIES, Server, ServeSettings

__all__ = ["POLICIES", "Server", "ServeSettings"]
