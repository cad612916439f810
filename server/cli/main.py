"""The `ember` command: serve, compile, generate (offline), bench-engine, bench (load generator).

OpenMP settings must be in the environment before torch is imported, so this module imports nothing heavy
at the top: idle OpenMP workers that spin would starve the uvicorn event loop on a 2-core machine.

Every engine and server setting resolves as: CLI flag > EMBER_* environment variable > --config TOML file >
built-in default (server/config_resolve.py). The parsers below hold only the built-in defaults.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from server.config_resolve import (
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

if TYPE_CHECKING:
    from engine.config import EngineConfig

AddArgs = Callable[[argparse.ArgumentParser], None]
DEFAULT_BUCKETS_TEXT = "1,2,4,8,16,24,32"  # engine.config.DEFAULT_BUCKETS, as the flag is written


# OpenMP workers spin this many rounds (well under a millisecond) after a parallel region before sleeping. A decode
# step runs ~150 short regions (every linear and attention call): with no spin (OMP_WAIT_POLICY=PASSIVE) each
# one paid a futex wake-up, 37 vs 53-62 tok/s at batch 1 and 483 vs 817 at batch 32. With libgomp's default
# spin (or ACTIVE) idle workers keep a core busy and starve the HTTP event loop on small machines.
DEFAULT_GOMP_SPINCOUNT = "10000"


def _set_thread_env() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:  # an explicit choice wins
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"buckets must be comma-separated integers, got {text!r}") from exc


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags with their built-in defaults; EMBER_* env vars and --config files are applied afterwards by
    server.config_resolve (flag > env > config > default), which is why no default here reads the environment."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weight and KV dtype (default: %(default)s)")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: sized from available memory with --mem-fraction)")
    g.add_argument("--mem-fraction", type=float, default=0.3,
                   help="fraction of available memory for the KV pool when --max-total-tokens is unset "
                        "(default: %(default)s)")
    g.add_argument("--max-running-requests", type=int, default=32,
                   help="largest decode batch, and the largest decode bucket (default: %(default)s)")
    g.add_argument("--max-context-len", type=int, default=None,
                   help="context length limit (default: the model's, capped at 32768)")
    g.add_argument("--decode-buckets", type=_buckets, default=DEFAULT_BUCKETS_TEXT,
                   help="decode batch-size buckets, capped by --max-running-requests; each one is compiled at "
                        "start-up (default: %(default)s)")
    g.add_argument("--disable-compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run the decode step eagerly: no compile at start-up, slower decode (default: %(default)s)")
    g.add_argument("--compile-cache-dir", default=_default_cache_dir(),
                   help="persistent cache: inductor's kernels, each bucket's saved decode step and a prepared "
                        "copy of the model, so a restart skips compiling and checkpoint parsing "
                        "(default: %(default)s)")
    g.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=False,
                   help="inductor C++ wrapper for the decode graphs (default: %(default)s)")
    g.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="most prompt tokens prefilled in one step (default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=None, help="torch compute threads (default: all cores)")


def _default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember")


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of settings named like the flags, e.g. configs/smollm2.toml; precedence: "
                        f"flag > EMBER_* env > config > default (env {CONFIG_ENV}; default: none)")
    g.add_argument("--print-config", action="store_true",
                   help="print every resolved setting and where it came from (flag/env/config/default), then exit")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, max_total_tokens=args.max_total_tokens, mem_fraction=args.mem_fraction,
        max_running_requests=args.max_running_requests, max_context_len=args.max_context_len,
        decode_buckets=args.decode_buckets, disable_compile=args.disable_compile,
        compile_cache_dir=args.compile_cache_dir, cpp_wrapper=args.cpp_wrapper,
        chunked_prefill_size=args.chunked_prefill_size, max_queued_requests=args.max_queued_requests,
        num_threads=args.num_threads,
    )


def _generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    # One prompt needs one bucket: compiling the other six would only cost start-up time.
    config = replace(engine_config_from_args(args), max_running_requests=1)
    core = EngineCore(config)
    tok = core.tokenizer
    ids: list[int]
    if args.chat:  # tokenize=True, return_dict=False: a flat list of token ids
        ids = cast(list[int], tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False))
    else:
        ids = tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    core.add(core.make_requests("cli", list(ids), params))
    while core.has_work():
        for out in core.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve_args() -> tuple[AddArgs | None, Callable[[argparse.Namespace], int] | None]:
    try:
        from server.serve import add_serve_args, run_serve
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
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")

    bench = commands["bench-engine"] = sub.add_parser(
        "bench-engine", help="offline decode tokens/s of the compiled runner vs transformers")
    add_engine_args(bench)
    from server.bench_engine import add_bench_args

    add_bench_args(bench)

    load = commands["bench"] = sub.add_parser(
        "bench", help="load-test any OpenAI-compatible server: tokens/s, TTFT, inter-token latency, peak RSS")
    from server.bench_load import add_load_bench_args

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
            return _generate(args)
        if args.command == "compile":
            from server.compile_cmd import run_compile

            return run_compile(engine_config_from_args(args))
        if args.command == "bench":
            from server.bench_load import run_load_bench

            return run_load_bench(args)
        if args.command == "bench-engine":
            from server.bench_engine import run_bench

            return run_bench(args)
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
