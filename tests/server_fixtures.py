"""Helpers for the server tests: a tiny random Llama folder and a real `ember serve` in a subprocess.

The tiny model has a real byte-level BPE tokenizer (trained here on a few sentences, so nothing is
downloaded) with a ChatML chat template, and random weights: its text is gibberish, but every token id,
length, stop and logprob path is exercised exactly as with a real model.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. Hello world, how are you today?",
    "a quick brown fox jumps over the lazy dog 0123456789",
    "Once upon a time there was a small model that answered questions.",
]


def make_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write a 2-layer random LlamaForCausalLM (vocab ~350) with its tokenizer into `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Scale up the output head so the random distribution is peaked: greedy decoding then has clear margins.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, bos_token_id=tok.bos_token_id).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        # Bounded readiness poll of a separate process: there is no event to wait on across processes.
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout} s:\n{server.log()[-4000:]}")


@contextmanager
def run_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
               timeout: float = 180.0) -> Iterator[Server]:
    """`python -m server.cli serve ARGS --port FREE` in a subprocess; yields once /health is 200."""
    port = free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("EMBER_API_KEY", None) if env is None or "EMBER_API_KEY" not in env else None
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
