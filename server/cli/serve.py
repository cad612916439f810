"""`ember serve`: the HTTP server's flags and its uvicorn run, with a graceful SIGTERM drain.

uvicorn's own SIGTERM handling closes the listening socket at once (new clients get "connection refused",
not a 503) and re-raises the signal after shutdown (exit status -15). We take the first SIGTERM / SIGINT
ourselves: /health and new requests answer 503 while running requests finish (up to the grace period, then
they are aborted with finish reason `abort`), and the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace

from server.api.settings import DEFAULT_MAX_REQUEST_BYTES, ServerSettings
from server.cli.engine_args import engine_config_from_args

log = logging.getLogger("ember.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=env("EMBER_HOST", "127.0.0.1"), help="bind address (default: %(default)s)")
    g.add_argument("--port", type=int, default=int(env("EMBER_PORT", "8000")), help="port (default: %(default)s)")
    g.add_argument("--api-key", default=env("EMBER_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(env EMBER_API_KEY)")
    g.add_argument("--served-model-name", default=env("EMBER_SERVED_MODEL_NAME"),
                   help="the model id clients use (default: the model folder name or GGUF file stem)")
    g.add_argument("--max-request-bytes", type=int,
                   default=int(env("EMBER_MAX_REQUEST_BYTES", str(DEFAULT_MAX_REQUEST_BYTES))),
                   help="largest request body; larger ones get 413 (default: %(default)s)")
    g.add_argument("--max-n", type=int, default=int(env("EMBER_MAX_N", "16")),
                   help="most choices (n) per request (default: %(default)s)")
    g.add_argument("--shutdown-grace-seconds", type=float, default=float(env("EMBER_SHUTDOWN_GRACE_SECONDS", "30")),
                   help="on SIGTERM, how long running requests may finish before they are aborted "
                        "(default: %(default)s)")
    g.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="serve as soon as the model is loaded: decode buckets that have no saved step compile in "
                        "the background, largest first, and are swapped in as each is ready; until then a batch runs "
                        "in a larger ready bucket or eagerly. They compile in a child process with one thread at the "
                        "lowest CPU priority (SCHED_IDLE), which saves each step into --compile-cache-dir for the "
                        "server to load, so serving keeps its speed; without a cache dir, or if the child fails, in "
                        "a thread of the server, which slows serving until they are done. --no-compile-in-background: "
                        "compile every bucket before /health is 200 (default: %(default)s)")
    g.add_argument("--tool-call-parser", default=env("EMBER_TOOL_CALL_PARSER", "auto"),
                   choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the format tool calls are read in (and forced in, for tool_choice required): auto picks it "
                        "from the chat template, hermes when the template has no tool support "
                        "(default: %(default)s)")
    g.add_argument("--reasoning-parser", default=env("EMBER_REASONING_PARSER", "auto"),
                   choices=["auto", "deepseek_r1", "qwen3", "none"],
                   help="read <think>...</think> reasoning out of chat outputs into reasoning_content: auto does it "
                        "for chat templates that mention <think>; none leaves any reasoning in the content "
                        "(default: %(default)s)")
    g.add_argument("--generation-config", default=env("EMBER_GENERATION_CONFIG", "auto"), choices=["auto", "none"],
                   help="auto: sampling fields a request leaves unset take the model's recommended values "
                        "(generation_config.json, a GGUF's general.sampling.* keys); none: OpenAI's defaults "
                        "(temperature 1) (default: %(default)s)")
    g.add_argument("--override-generation-config", default=env("EMBER_OVERRIDE_GENERATION_CONFIG", ""),
                   help='JSON object of sampling defaults over the model\'s, e.g. \'{"temperature": 0.2}\' '
                        "(a config file's [sampling] table sets it)")
    g.add_argument("--metrics-compat", default=env("EMBER_METRICS_COMPAT", "none"), choices=["none", "vllm"],
                   help="vllm: /metrics also exports vllm:num_requests_running, vllm:num_requests_waiting and "
                        "vllm:kv_cache_usage_perc (the same values as Ember's gauges), for routers that only know "
                        "vLLM's names, e.g. the Gateway API Inference Extension's endpoint picker "
                        "(default: %(default)s)")
    g.add_argument("--responses-store-size", type=int, default=int(env("EMBER_RESPONSES_STORE_SIZE", "1000")),
                   help="stored /v1/responses kept in memory for previous_response_id and GET /v1/responses/{id}, "
                        "least recently used evicted first; 0 stores none (default: %(default)s)")
    g.add_argument("--log-level", default=env("EMBER_LOG_LEVEL", "info"),
                   choices=["critical", "error", "warning", "info", "debug"], help="(default: %(default)s)")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
                          max_n=args.max_n, shutdown_grace_seconds=args.shutdown_grace_seconds,
                          log_level=args.log_level,
                          tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
                          metrics_compat=None if args.metrics_compat == "none" else args.metrics_compat,
                          reasoning_parser=None if args.reasoning_parser == "auto" else args.reasoning_parser,
                          generation_config=args.generation_config,
                          sampling_overrides=sampling_overrides(args.override_generation_config),
                          responses_store_size=args.responses_store_size)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_overrides(text: str) -> tuple[tuple[str, float], ...]:
    """--override-generation-config's JSON object, checked: only sampling fields, numbers only."""
    if not text.strip():
        return ()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SystemExit("--override-generation-config must be a JSON object")
    bad = [k for k, v in raw.items()
           if k not in SAMPLING_FIELDS or isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise SystemExit(f"--override-generation-config: {', '.join(bad)}: expected numbers for "
                         f"{', '.join(SAMPLING_FIELDS)}")
    return tuple((k, float(v)) for k, v in raw.items())


def run_serve(args: argparse.Namespace) -> int:
    # uvicorn and FastAPI are imported only here (~0.5 s): every other `ember` command builds this parser too.
    import uvicorn

    from server.api.app import create_app
    from server.cli.draining import DrainingServer

    logging.getLogger().setLevel(args.log_level.upper())
    settings = settings_from_args(args)
    config = replace(engine_config_from_args(args), background_compile=args.compile_in_background)
    server: DrainingServer | None = None

    def on_exit(code: int) -> None:
        if server is not None:
            server.stop(code)

    app = create_app(config, settings, on_exit)
    uv_config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                               log_config=None, access_log=False, timeout_graceful_shutdown=5,
                               timeout_keep_alive=5)
    server = DrainingServer(uv_config, app)
    log.info("listening on http://%s:%d (the engine loads in the background; /health is 503 until ready)",
             settings.host, settings.port)
    server.run()
    code = server.exit_code if server.started else 1
    engine = getattr(getattr(app.state, "server", None), "engine", None)
    if engine is not None and engine.error is None and (not engine.ready or engine.compiling):
        # Stopped while the engine thread is still loading or a bucket is compiling: neither can be interrupted, and
        # letting the interpreter finalize under it aborts the process (C++ threads torn down mid-compile). Leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
