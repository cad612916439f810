"""The engine in one object: model, pools, scheduler. Single-threaded; `engine_thread` runs it in the background.

Used directly (in the caller's thread) by the offline CLI, the benchmark and the tests.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.draft_model import DraftModel
from engine.grammar.compiler import GrammarCompiler
from engine.kv_manager import KVManager
from engine.loader import resolve_model_path
from engine.loader.pooling import model_pooling
from engine.kv_disk import DiskKVStore
from engine.loader.prepared import PreparedModel, checkpoint_fingerprint, open_cached, tokenizer_cached
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request import Pooling, Request
from engine.output_processor import OutputProcessor, take_output
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler
from engine.speculative import Speculator
from engine.stop import StopChecker

log = logging.getLogger("ember.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, on_bucket: Callable[[int, float], None] | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        config = self.config = config.resolved()  # the one the runner, the scheduler and the server all read
        # With a compile cache, a prepared copy of the checkpoint there saves a restart the parsing (~10 s for a GGUF).
        prepared = (PreparedModel(config.compile_cache_dir, resolve_model_path(config.model))
                    if config.compile_cache_dir else None)
        checkpoint = open_cached(config.model, prepared)
        self.model_config = checkpoint.config
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_cached(config.model, prepared)
        self.runner = ModelRunner(config, checkpoint, on_bucket, prepared)
        self.max_context = self.runner.max_context
        # With the prefix cache off, sliding-window layers keep only each request's last window of K/V (rings,
        # engine/pools.py WindowKVPool); with it on, in slots of their own (engine/window_slots.py).
        prefix_cache = not config.disable_prefix_cache
        disk = None
        if prefix_cache and config.kv_disk_cache_size and config.compile_cache_dir:
            identity = self.runner.kv_identity(checkpoint_fingerprint(resolve_model_path(config.model)))
            disk = DiskKVStore(Path(config.compile_cache_dir), identity, config.kv_disk_cache_size * 2**20,
                               self.runner.kv_pool)
            log.info("KV disk tier: %s, up to %d MiB (%.0f MiB there now)", disk.dir, config.kv_disk_cache_size,
                     disk.stats.bytes / 2**20)
        mc = self.model_config
        self.kvm = KVManager(self.runner.kv_pool, self.runner.req_pool, prefix_cache=prefix_cache, disk=disk,
                             window=mc.sliding_window)
        # Drafts are verified as extra decode rows of their request (sliding-window rings keep spare entries for
        # them: engine/pools.py WindowKVPool).
        graphs = self.runner.graphs
        self.speculator, self.drafter = None, None
        if config.speculative != "off":
            self.drafter = (DraftModel(config, self.runner.kv_pool.num_slots, mc.vocab_size, self.tokenizer, on_bucket)
                            if config.speculative == "draft" else None)
            self.speculator = Speculator(graphs.buckets, lambda b: b in graphs.fns, config.num_speculative_tokens,
                                         self.drafter)
        self.outputs = OutputProcessor(self.kvm, mc.eos_token_ids, mc.vocab_size, self.max_context, self.speculator)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.scheduler = Scheduler(self.kvm, self.outputs, config, self.speculator)
        self.pooling: Pooling = model_pooling(config.model, config.pooling)

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      validate: bool = True) -> list[Request]:
        """The n sequences of one request, validated against the model's limits first unless the caller has
        (`validate`). A grammar compiles here unless it is cached: the server compiles it first, on its grammar
        thread (EngineClient callers must, or the event loop pays the compile)."""
        if validate:
            self.validate(prompt_ids, params)
        room = self.max_context - len(prompt_ids)
        return [
            Request(
                request_id=request_id, index=i, prompt_ids=list(prompt_ids), params=params,
                max_new_tokens=min(params.max_tokens or room, room),
                detok=IncrementalDetokenizer(self.tokenizer, list(prompt_ids), params.skip_special_tokens),
                stop=StopChecker(params.stop),
                seed=None if params.seed is None else params.seed + i,
                matcher=None if params.grammar is None else self.grammars.matcher(params.grammar),
            )
            for i in range(params.n)
        ]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything that makes the engine refuse a prompt: raises SamplingParamsError (GrammarError among them,
        for a grammar that does not compile). Reads only what is fixed once the model is loaded, so any thread may
        call it."""
        if not prompt_ids:
            raise SamplingParamsError("the prompt must contain at least one token", "prompt")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise SamplingParamsError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if any(t < 0 or t >= vocab for t in (*params.logit_bias, *params.stop_token_ids)):
            raise SamplingParamsError(f"token ids must be in [0, {vocab})", "logit_bias")
        room = self.max_context - len(prompt_ids)
        wanted = params.max_tokens or 1
        if room < wanted:
            raise SamplingParamsError(
                f"this model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens asks for {wanted} more", "max_tokens")
        if len(prompt_ids) + wanted > self.runner.kv_pool.num_slots:
            raise SamplingParamsError(
                f"prompt plus max_tokens ({len(prompt_ids) + wanted} tokens) exceeds the KV pool "
                f"({self.runner.kv_pool.num_slots} tokens)", "max_tokens")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # raises GrammarError; cached, so the matcher later is cheap

    def make_embedding_request(self, request_id: str, prompt_ids: list[int], pooling: Pooling) -> Request:
        """A prefill-only request whose output is the pooled, L2-normalised final hidden state of its prompt."""
        self.validate_embedding(prompt_ids)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        return Request(request_id=request_id, index=0, prompt_ids=list(prompt_ids), params=params, max_new_tokens=0,
                       detok=IncrementalDetokenizer(self.tokenizer, list(prompt_ids), True), stop=StopChecker(()),
                       pooling=pooling)

    def validate_embedding(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise SamplingParamsError("an embedding input must contain at least one token", "input")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise SamplingParamsError(f"input token ids must be in [0, {vocab})", "input")
        limit = min(self.max_context, self.runner.kv_pool.num_slots)
        if len(prompt_ids) > limit:
            raise SamplingParamsError(
                f"this model's maximum context length is {limit} tokens; the input has {len(prompt_ids)} tokens",
                "input")

    def close(self) -> None:
        """Finish writing the disk tier's queued blocks (a restart then finds them); stop the draft's compile."""
        if self.kvm.disk is not None:
            self.kvm.disk.close()
        if self.drafter is not None:
            self.drafter.stop()

    def add(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.scheduler.add(req)

    def abort(self, request_id: str) -> list[RequestOutput]:
        return [o for r in self.scheduler.abort(request_id) if (o := take_output(r)) is not None]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step in three phases: the scheduler decides a batch, the runner runs it, the output
        processor samples, checks stops and releases KV; then the scheduler updates its queues. Returns the
        outputs staged by it (and by requests the scheduler retracted or finished without a forward)."""
        batch = self.scheduler.schedule()
        touched = list(self.scheduler.take_touched())
        if batch is not None:
            t0 = time.perf_counter()
            logits = self.runner.forward(batch)
            self.outputs.process(batch, logits)
            self.scheduler.update(batch, time.perf_counter() - t0)
            touched.extend(batch.reqs)
        return [o for r in touched if (o := take_output(r)) is not None]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline: run prompts to completion, return each request's output token ids (choice 0)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            self.add(self.make_requests(f"offline-{i}", p, sp))
        outs: dict[str, list[int]] = {f"offline-{i}": [] for i in range(len(prompts))}
        while self.has_work():
            for o in self.step():
                if o.index == 0:
                    outs[o.request_id].extend(o.token_ids)
        return [outs[f"offline-{i}"] for i in range(len(prompts))]
