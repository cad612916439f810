"""Small helpers every router uses: the shared state, and the checks that come before any engine work."""
from __future__ import annotations

from fastapi import Request

from server.api.errors import APIError, unavailable
from server.api.state import ServerState


def get_state(request: Request) -> ServerState:
    """The state built by the lifespan; 503 while the engine is still loading (or has failed to load)."""
    state: ServerState = request.app.state.server
    if not state.engine.ready:
        failed = state.engine.error is not None
        raise unavailable("the engine has failed (see the server log)" if failed else "the engine is still loading",
                          state.settings.retry_after_seconds)
    return state


def check_model(state: ServerState, model: str | None) -> None:
    """A request naming a model must name the served one (None: the served model)."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
