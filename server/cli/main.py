"""The `ember` command: serve, compile, generate (offline), bench-engine, bench (load generator).

OpenMP settings must be in the environment before torch is imported, so this module imports nothing heavy
at the top: idle OpenMP workers that spin would starve the uvicorn event loop on a 2-core machine.

Every engine and server setting resolves as: CLI flag > EMBER_* environment variable > --config TOML file >
built-in default (server/cli/config_resolve.py). The parsers hold only the built-in defaults.

Each subcommand's flags and its run live in their own module: serve.py, compile.py, generate.py here, and
server/bench/ for the client-side tools. This module only assembles the parser and dispatches.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine.omp_env import set_thread_env
from server.cli.config_resolve import (
    CONFIG_ENV,
    ConfigError,
    apply,
    config_path_of,
    env_name,
    explicit_values,
    format_settings,
    load_config_file,
    resolve,
    setting_dests,
)
from server.cli.engine_args import add_engine_args, engine_config_from_args
from server.cli.generate import add_generate_args, run_generate

AddArgs = Callable[[argparse.ArgumentParser], None]


def _set_thread_env() -> None:
    set_thread_env()  # engine/omp_env.py: the OpenMP spin the server runs with
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of settings named like the flags, e.g. configs/smollm2.toml; precedence: "
                        f"flag > EMBER_* env > config > default (env {CONFIG_ENV}; default: none)")
    g.add_argument("--print-config", action="store_true",
                   help="print every resolved setting and where it came from (flag/env/config/default), then exit")


def _serve_args() -> tuple[AddArgs | None, Callable[[argparse.Namespace], int] | None]:
    try:
        from server.cli.serve import add_serve_args, run_serve
    except ImportError:  # pragma: no cover - the HTTP layer is optional at this stage
        return None, None
    return add_serve_args, run_serve


def _document(p: argparse.ArgumentParser, dests: set[str]) -> None:
    """Every setting's help names its env var and its default, whoever wrote the flag."""
    for action in p._actions:  # argparse has no public enumeration of actions
        if action.dest not in dests or action.help is None:
            continue
        if "default" not in action.help:
            action.help += " (default: %(default)s)"
        if env_name(action.dest) not in action.help:
            action.help += f" [env {env_name(action.dest)}]"


@contextmanager
def _ember_env_hidden() -> Iterator[None]:
    """No EMBER_* variable while the parsers are built: add_serve_args reads some into its defaults, and the
    parsers must hold only built-in defaults (the resolver applies the env, with its own error messages)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("EMBER_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], list[str]]:
    """(the parser, each subcommand's parser, the dests of every engine and server setting)."""
    with _ember_env_hidden():
        return _build_parser()


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], list[str]]:
    add_serve_args, _ = _serve_args()
    dests = setting_dests(add_engine_args) + (setting_dests(add_serve_args) if add_serve_args else [])
    parser = argparse.ArgumentParser(prog="ember", description="Ember: an LLM serving engine for CPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}

    serve = commands["serve"] = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    if add_serve_args is not None:
        add_serve_args(serve)

    compile_ = commands["compile"] = sub.add_parser(
        "compile", help="compile every configured decode bucket into --compile-cache-dir, then exit")
    add_engine_args(compile_)

    gen = commands["generate"] = sub.add_parser(
        "generate", help="complete one prompt offline; prints only the completion to stdout")
    add_engine_args(gen)
    add_generate_args(gen)

    bench = commands["bench-engine"] = sub.add_parser(
        "bench-engine", help="offline decode tokens/s of the compiled runner vs transformers")
    add_engine_args(bench)
    from server.bench.engine import add_bench_args

    add_bench_args(bench)

    load = commands["bench"] = sub.add_parser(
        "bench", help="load-test any OpenAI-compatible server: tokens/s, TTFT, inter-token latency, peak RSS")
    from server.bench.load import add_load_bench_args

    add_load_bench_args(load)
    for p in commands.values():
        add_config_args(p)
        _document(p, set(dests))
    return parser, commands, dests


def resolve_args(argv: list[str]) -> tuple[argparse.Namespace, str | None]:
    """Parse `argv` and resolve every setting in place (flag > env > config > default).

    Returns the namespace and, when --print-config was given, the text to print instead of running.
    """
    parser, commands, dests = build_parser()
    args = parser.parse_args(argv)
    command_parser = commands[args.command]
    explicit = explicit_values(parser, command_parser, argv)
    config_path, config_source = config_path_of(explicit, os.environ)
    config = load_config_file(config_path) if config_path else {}
    settings = resolve(command_parser, explicit, dests, config, config_path, os.environ)
    apply(args, settings)
    args.config = config_path
    return args, format_settings(settings, config_path, config_source) if args.print_config else None


def main(argv: list[str] | None = None) -> int:
    _set_thread_env()
    try:
        args, printed = resolve_args(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        return 2
    if printed is not None:
        print(printed)
        return 0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            code = run_generate(engine_config_from_args(args), args)
            # The answer is out: skip the interpreter's teardown of torch and the model, ~0.8 s of a short
            # `ember generate` on the AVX2 machine (a script waits for the process, not for the text).
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if args.command == "compile":
            from server.cli.compile import run_compile

            return run_compile(engine_config_from_args(args))
        if args.command == "bench":
            from server.bench.load import run_load_bench

            return run_load_bench(args)
        if args.command == "bench-engine":
            from server.bench.engine import run_bench

            return run_bench(engine_config_from_args(args), args)
        _, run_serve = _serve_args()
        if run_serve is None:
            print("ember: error: the HTTP server is not available in this build", file=sys.stderr)
            return 2
        return run_serve(args)
    except (FileNotFoundError, ValueError, MemoryError) as exc:  # bad model path, unsupported model, sizing
        print(f"ember: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
