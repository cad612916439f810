"""`ember generate`: complete one prompt offline on an EngineCore (no HTTP) and print only the completion."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from engine.config import EngineConfig


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="decode with the compiled batch-1 graph (saved in --compile-cache-dir): ~2x faster per token, "
                        "but loading it costs ~4.5 s (importing dynamo, reading the saved step) and compiling it the "
                        "first time ~30 s, so it only pays for answers of several hundred tokens (default: eager)")


def run_generate(config: EngineConfig, args: argparse.Namespace) -> int:
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    # One prompt needs one bucket: compiling the other six would only cost start-up time. Eager by default: a short
    # answer is ready before the compiled step would be loaded (measured on AVX2: 6.2 s eager, 9.9 s compiled).
    core = EngineCore(replace(config, max_running_requests=1,
                              disable_compile=config.disable_compile or not args.compile))
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
