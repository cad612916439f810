"""The engine's command-line flags (shared by serve, compile, generate and bench-engine) and the EngineConfig
built from them.

Only built-in defaults live here: EMBER_* env vars and --config files are applied afterwards by
server/cli/config_resolve.py (flag > env > config > default), which is why no default here reads the
environment. Nothing heavy is imported at the top (see server/cli/main.py).
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig

DEFAULT_BUCKETS_TEXT = "1,2,4,8,16,24,32"  # engine.config.DEFAULT_BUCKETS, as the flag is written


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"buckets must be comma-separated integers, got {text!r}") from exc


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags with their built-in defaults (the resolver applies env and config files afterwards)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="activation, KV and dense-weight dtype; auto: bfloat16 (float32 with --quantization none is "
                        "the exact-parity path) (default: %(default)s)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="auto: a GGUF's own formats (Q4_1, Q8_0, Q4_K, ...) on Ember's quantized kernels, a HF folder "
                        "dense; none: every weight dequantized to --dtype (the exact-parity path); int8 / int4: "
                        "quantize a checkpoint's weights at load (default: %(default)s)")
    g.add_argument("--quant-group-size", type=int, default=32, choices=[32, 128],
                   help="inputs per scale for --quantization int4 (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8", "fp8_e4m3"],
                   help="KV cache storage; auto: --dtype; int8 / fp8_e4m3: a byte a value and a scale per token and KV "
                        "head, about 2x the tokens of bfloat16 (3.8x of float32) in the same memory "
                        "(default: %(default)s)")
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
    g.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode steps with inductor's C++ wrapper: the ~450 calls a step makes go from "
                        "C++ instead of Python (SmolLM2's one-row step ~12 %% faster), for about twice the compile "
                        "time of each bucket on a cold cache (default: %(default)s)")
    g.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="most prompt tokens prefilled in one step (default: %(default)s)")
    g.add_argument("--disable-prefix-cache", action=argparse.BooleanOptionalAction, default=False,
                   help="recompute every prompt instead of reusing the K/V of cached prefixes (default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=None, help="torch compute threads (default: all cores)")
    g.add_argument("--speculative", default="ngram", choices=["ngram", "draft", "off"],
                   help="speculative decoding: ngram drafts the continuation of the latest earlier match of a "
                        "request's last tokens in its own prompt and output; draft runs --draft-model's greedy "
                        "decode; either is verified in the decode step, and only when measured step times say it "
                        "pays (default: %(default)s)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="with --speculative draft: a small model (HF folder or .gguf) with the model's tokenizer "
                        "that drafts for it, with its own KV pool and compiled decode steps")
    g.add_argument("--num-speculative-tokens", type=int, default=15,
                   help="most draft tokens a request verifies per step (default: %(default)s)")
    g.add_argument("--kv-disk-cache-size", type=int, default=0, metavar="MIB",
                   help="MiB of the prefix cache's disk tier under --compile-cache-dir: cached K/V is written "
                        "through and read back on a miss, so it survives restarts and is shared by replicas on one "
                        "volume; 0 = off (default: %(default)s)")
    g.add_argument("--window-kv-ratio", type=float, default=0.25, metavar="R",
                   help="sliding-window models with the prefix cache on: slots of the window layers' K/V per "
                        "token-pool slot; only positions still in a request's window need one, the rest keep cached "
                        "prefixes resumable (at least what the running requests' windows need; default: %(default)s)")
    g.add_argument("--pooling", default="auto", choices=["auto", "mean", "last"],
                   help="how /v1/embeddings pools a prompt's final hidden states; auto: the model folder's "
                        "sentence-transformers pooling config (last token for Qwen3-Embedding), else mean "
                        "(default: %(default)s)")


def _default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, quant_group_size=args.quant_group_size,
        kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=args.max_total_tokens, mem_fraction=args.mem_fraction,
        max_running_requests=args.max_running_requests, max_context_len=args.max_context_len,
        decode_buckets=args.decode_buckets, disable_compile=args.disable_compile,
        compile_cache_dir=args.compile_cache_dir, cpp_wrapper=args.cpp_wrapper,
        chunked_prefill_size=args.chunked_prefill_size, max_queued_requests=args.max_queued_requests,
        disable_prefix_cache=args.disable_prefix_cache, num_threads=args.num_threads, pooling=args.pooling,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        kv_disk_cache_size=args.kv_disk_cache_size, window_kv_ratio=args.window_kv_ratio,
    )
