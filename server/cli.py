"""The `ember` command: serve, generate (offline), bench-engine.

OpenMP settings must be in the environment before torch is imported, so this module imports nothing heavy
at the top: idle OpenMP workers that spin would starve the uvicorn event loop on a 2-core machine.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


def _set_thread_env() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"buckets must be comma-separated integers, got {text!r}") from exc


def add_engine_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env("EMBER_MODEL"),
                   help="HF folder or .gguf file (env EMBER_MODEL; default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=env("EMBER_DTYPE", "bfloat16"), choices=["bfloat16", "float32"],
                   help="weight and KV dtype (env EMBER_DTYPE; default: %(default)s)")
    g.add_argument("--max-total-tokens", type=int, default=_int_env("EMBER_MAX_TOTAL_TOKENS"),
                   help="KV pool size in tokens (env EMBER_MAX_TOTAL_TOKENS; default: sized from free memory)")
    g.add_argument("--mem-fraction", type=float, default=float(env("EMBER_MEM_FRACTION", "0.3")),
                   help="fraction of available memory for the KV pool when --max-total-tokens is unset "
                        "(env EMBER_MEM_FRACTION; default: %(default)s)")
    g.add_argument("--max-running-requests", type=int, default=int(env("EMBER_MAX_RUNNING_REQUESTS", "32")),
                   help="largest decode batch (env EMBER_MAX_RUNNING_REQUESTS; default: %(default)s)")
    g.add_argument("--max-context-len", type=int, default=_int_env("EMBER_MAX_CONTEXT_LEN"),
                   help="context length limit (env EMBER_MAX_CONTEXT_LEN; default: the model's, capped at 32768)")
    g.add_argument("--decode-buckets", type=_buckets, default=_buckets(env("EMBER_DECODE_BUCKETS", "1,2,4,8,16,24,32")),
                   help="decode batch-size buckets, capped by --max-running-requests "
                        "(env EMBER_DECODE_BUCKETS; default: 1,2,4,8,16,24,32)")
    g.add_argument("--disable-compile", action="store_true", default=env("EMBER_DISABLE_COMPILE", "") == "1",
                   help="run the decode step eagerly (env EMBER_DISABLE_COMPILE=1)")
    g.add_argument("--compile-cache-dir", default=env("EMBER_COMPILE_CACHE_DIR"),
                   help="persistent torch.compile cache directory (env EMBER_COMPILE_CACHE_DIR)")
    g.add_argument("--cpp-wrapper", action="store_true", default=env("EMBER_CPP_WRAPPER", "") == "1",
                   help="inductor C++ wrapper for the decode graphs (env EMBER_CPP_WRAPPER=1)")
    g.add_argument("--chunked-prefill-size", type=int, default=int(env("EMBER_CHUNKED_PREFILL_SIZE", "512")),
                   help="most prompt tokens prefilled in one step (env EMBER_CHUNKED_PREFILL_SIZE; default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=int(env("EMBER_MAX_QUEUED_REQUESTS", "1024")),
                   help="waiting requests beyond which new ones get 503 (env EMBER_MAX_QUEUED_REQUESTS; "
                        "default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=_int_env("EMBER_NUM_THREADS"),
                   help="torch compute threads (env EMBER_NUM_THREADS; default: all cores)")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


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
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
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


def main(argv: list[str] | None = None) -> int:
    _set_thread_env()
    parser = argparse.ArgumentParser(prog="ember", description="Ember: an LLM serving engine for CPUs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline; prints only the completion to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")

    bench = sub.add_parser("bench-engine", help="offline decode tokens/s of the compiled runner vs transformers")
    add_engine_args(bench)
    from server.bench_engine import add_bench_args

    add_bench_args(bench)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    try:
        from server.serve import add_serve_args, run_serve
    except ImportError:  # pragma: no cover - the HTTP layer is optional at this stage
        add_serve_args, run_serve = None, None
    if add_serve_args is not None:
        add_serve_args(serve)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench-engine":
            from server.bench_engine import run_bench

            return run_bench(args)
        if run_serve is None:
            parser.error("the HTTP server is not available in this build")
        return run_serve(args)
    except (FileNotFoundError, ValueError, MemoryError) as exc:  # bad model path, unsupported model, sizing
        print(f"ember: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
