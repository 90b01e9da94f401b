"""An OpenAI-compatible HTTP server on the engine: continuous batching on llama.cpp.

`skippy-scheduler serve` runs it (`pip install 'skippy-scheduler[serve]'`). The pieces:

* `server`: `ServeSettings` and `Server` (model, host, scheduler, engine thread, uvicorn);
* `runner`: the engine on its own thread, one event subscription per request;
* `app`: FastAPI routes, request translation, SSE streaming, disconnect handling;
* `body`: reading a body within its size and time limits, JSON that later steps can trust;
* `guard`: the ASGI middleware refusing foreign `Host` names and ambiguous framing;
* `connections`: the h11 protocol's head deadline and connection cap, the shutdown deadline;
* `protocol`: OpenAI request bodies to generation requests (400s that name the field);
* `text`: incremental UTF-8-safe detokenisation and stop strings;
* `chat`: chat templates (ChatML here, a model's own through llama.cpp); `metrics`: Prometheus;
  `errors`: error bodies.

What the server asks of its host is the serving seam of engine/contract.py (`ServingHost` and
its optional capabilities); the HTTP app itself imports nothing of llama-cpp-python.
"""
from ..selection import POLICIES
from .server import Server, ServeSettings

__all__ = ["POLICIES", "Server", "ServeSettings"]
