"""The error of a request the engine refuses, in a module of its own: engine.grammar.spec derives from it, and
engine.sampling_params (which re-exports it) refers to GrammarSpec, so neither may import the other."""
from __future__ import annotations


class SamplingParamsError(ValueError):
    """A sampling field is out of range; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
