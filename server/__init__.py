"""Ember's HTTP face (FastAPI on uvicorn) and the `ember` command line."""
