"""Ember's engine: model, pools, compiled decode runner, scheduler. Never imports FastAPI."""
