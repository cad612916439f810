"""Drive a ModelRunner by hand (no scheduler) and compare it with transformers, for the engine-core tests."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner


def make_runner(model_dir: Path, *, compile: bool, buckets: tuple[int, ...] = (1, 2, 4), max_running: int = 4,
                dtype: str = "float32", max_total_tokens: int = 4096, rings: bool = False,
                kv_cache_dtype: str = "auto") -> ModelRunner:
    """rings: a sliding-window model's window layers in per-request rings (the prefix cache off) instead of the
    token pool."""
    config = EngineConfig(model=str(model_dir), dtype=dtype, max_total_tokens=max_total_tokens,
                          kv_cache_dtype=kv_cache_dtype, max_running_requests=max_running, decode_buckets=buckets,
                          disable_compile=not compile, disable_prefix_cache=rings)
    return ModelRunner(config, open_checkpoint(str(model_dir)))


def hf_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class ManualBatch:
    """Prefill some prompts, then decode them together; records every step's logits."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.rows: list[int] = []
        chunks = []
        for p in prompts:
            row = runner.req_pool.allocate()
            slots = runner.kv_pool.allocate(len(p))
            assert row is not None and slots is not None
            self.rows.append(row)
            chunks.append(PrefillChunk(row, 0, p, slots))
        self.prefill_logits = runner.forward(ForwardBatch.prefill(chunks))
        self.seqs = [p + [int(t)] for p, t in zip(prompts, self.prefill_logits.argmax(-1))]
        self.step_logits: list[torch.Tensor] = []

    def decode(self, steps: int) -> list[list[int]]:
        rows = torch.tensor(self.rows, dtype=torch.int64)
        for _ in range(steps):
            slots = self.runner.kv_pool.allocate(len(self.rows))
            assert slots is not None
            positions = torch.tensor([len(s) - 1 for s in self.seqs], dtype=torch.int64)
            ids = torch.tensor([s[-1] for s in self.seqs], dtype=torch.int64)
            logits = self.runner.forward(ForwardBatch.decode(ids, positions, rows, slots))
            self.step_logits.append(logits)
            self.seqs = [s + [int(t)] for s, t in zip(self.seqs, logits.argmax(-1))]
        return self.seqs

    def release(self) -> None:
        for row, seq in zip(self.rows, self.seqs):
            # the last sampled token was never fed back, so its K/V is not in the pool
            self.runner.kv_pool.free(self.runner.req_pool.table[row, : len(seq) - 1].to(torch.int64))
            self.runner.req_pool.free(row)


def assert_greedy_close(ours: list[torch.Tensor], ref: list[torch.Tensor], cosine: float) -> float:
    """Per request, every step's logits at least `cosine`-similar to the reference's and the same greedy token, up
    to a divergence that is allowed only where the reference's top two logits are closer than the two sides'
    largest difference at that step (a tie within the error present); after it the two decode different tokens,
    so that request's comparison stops. Returns the largest error seen, as a fraction of the step's max logit."""
    worst = 0.0
    for row in range(ours[0].shape[0]):
        for step, (a, b) in enumerate(zip(ours, ref)):
            err = float((a[row] - b[row]).abs().max())
            worst = max(worst, err / float(b[row].abs().max()))
            cos = float(torch.nn.functional.cosine_similarity(a[row], b[row], dim=0))
            assert cos >= cosine, f"request {row}, step {step}: cosine {cos:.6f}"
            if int(a[row].argmax()) != int(b[row].argmax()):
                top2 = b[row].topk(2).values
                assert float(top2[0] - top2[1]) <= 2 * err, f"request {row} diverged at step {step} off a near-tie"
                break
    return worst
