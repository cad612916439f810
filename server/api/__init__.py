"""The HTTP API: the FastAPI app and everything a request touches (routes, pydantic protocol models, prompt
rendering, generation, SSE streaming, errors, auth, limits, metrics, app state, the server's settings).

Imports only from itself and from `engine`; never from server.cli or server.bench."""
