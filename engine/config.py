"""Every engine setting in one frozen dataclass. Built once (CLI > EMBER_* env > TOML > default) and never mutated."""
from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8", "int4")
SPECULATIVE_MODES: tuple[str, ...] = ("ngram", "draft", "off")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the embedded SmolLM2-135M-Instruct
    # auto | bfloat16 | float32: activations, KV and dense weights. auto = bfloat16 (resolved): quantized linears
    # take int8 activations anyway, and perplexity matched fp32's (docs/quantization.md); float32 with
    # --quantization none is the exact-parity path.
    dtype: str = "auto"
    # auto: a GGUF's own quantized formats, a HF folder dense; none: dense in `dtype`; int8 / int4: quantized at
    # load (engine/quant/quantize.py), int4 in groups of quant_group_size inputs
    quantization: str = "auto"
    quant_group_size: int = 32
    # The KV cache's storage. auto: the serving dtype; int8 / fp8_e4m3: a byte a value and an absmax scale per
    # (token, KV head), about 2x the tokens of bf16 in the same memory (engine/ops/kv_quant.py)
    kv_cache_dtype: str = "auto"
    max_total_tokens: int | None = None  # KV slots; None = sized from available memory
    mem_fraction: float = 0.3  # of available memory given to the KV pool when max_total_tokens is unset
    max_running_requests: int = 32
    max_context_len: int | None = None  # None = the model's max_position_embeddings (capped at 32768)
    decode_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    disable_compile: bool = False
    background_compile: bool = False  # serve before every decode bucket is compiled (engine/decode_graphs.py)
    compile_cache_dir: str | None = None
    cpp_wrapper: bool = False  # inductor's C++ wrapper for the decode steps; `ember serve`'s default is on (faster
    # steps, slower cold compiles); off here, as the library's other compile defaults, so in-process uses compile fast
    chunked_prefill_size: int = 512
    disable_prefix_cache: bool = False  # recompute every prompt instead of reusing cached prefixes' KV
    max_queued_requests: int = 1024
    num_threads: int | None = None  # torch threads; None = all cores
    seed: int = 0
    # /v1/embeddings: how a prompt's final hidden states are pooled. auto: what the model folder says
    # (sentence-transformers' 1_Pooling/config.json: last token for decoder embedding models such as
    # Qwen3-Embedding), else mean (engine/loader/pooling.py)
    pooling: str = "auto"
    # Speculative decoding (engine/speculative.py): ngram = prompt-lookup drafts, verified in the decode batch's
    # own compiled step, drafted only when the measured step times and acceptance say it pays; off = one token per
    # step; draft = a small model with the same tokenizer (draft_model, HF folder or GGUF) drafts by its own
    # greedy decode (engine/draft_model.py). num_speculative_tokens caps a request's drafts per step: 15, since the
    # planner already stops a draft where its expected gain no longer pays (against 7, two alternated rounds of the
    # default model on the AMX Xeon: extract 1.06x and free text 1.18x at one client, the rest within the spread).
    speculative: str = "ngram"
    num_speculative_tokens: int = 15
    draft_model: str | None = None
    # MiB of the prefix cache's disk tier under compile_cache_dir (engine/kv_disk.py): cached K/V written through,
    # read back on a miss, kept across restarts; 0 = off
    kv_disk_cache_size: int = 0
    # Sliding-window models with the prefix cache on: window-layer slots per token-pool slot (engine/window_slots.py).
    # Only positions in some request's window need theirs; the rest keep cached prefixes resumable at more points.
    window_kv_ratio: float = 0.25

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quant_group_size not in (32, 128):
            raise ValueError(f"quant_group_size must be 32 or 128, got {self.quant_group_size}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if not self.decode_buckets or any(b < 1 for b in self.decode_buckets):
            raise ValueError(f"decode buckets must be positive integers, got {self.decode_buckets}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError("mem_fraction must be in (0, 1)")
        if not 0.0 < self.window_kv_ratio <= 1.0:
            raise ValueError("window_kv_ratio must be in (0, 1]")
        if self.pooling not in ("auto", "mean", "last"):
            raise ValueError(f"pooling must be auto, mean or last, got {self.pooling!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft and --draft-model PATH go together: the draft model drafts only in "
                             "draft mode, and draft mode needs one")
        if not 1 <= self.num_speculative_tokens <= 31:
            raise ValueError("num_speculative_tokens must be in [1, 31]")
        if self.kv_disk_cache_size < 0:
            raise ValueError("kv_disk_cache_size must be >= 0 (MiB; 0 = off)")
        if self.chunked_prefill_size < 16:
            raise ValueError("chunked_prefill_size must be at least 16")

    @property
    def buckets(self) -> tuple[int, ...]:
        """Sorted buckets capped by max_running_requests; the cap itself is always a bucket."""
        cap = self.max_running_requests
        kept = sorted({b for b in self.decode_buckets if b < cap} | {cap})
        return tuple(kept)

    def quantization_plan(self, gguf: bool) -> tuple[bool, str | None]:
        """(keep the checkpoint's quantized tensors, quantize dense weights at load to this mode or None)."""
        if self.quantization in ("int8", "int4"):
            return False, self.quantization
        return self.quantization == "auto" and gguf, None

    def weights_tag(self, gguf: bool) -> str:
        """Names the served weights' form: prepared-cache entries and saved decode steps differ by it."""
        keep, mode = self.quantization_plan(gguf)
        if mode == "int4":
            return f"int4g{self.quant_group_size}"
        return mode or ("native" if keep else "dense")

    def resolved(self) -> EngineConfig:
        """This config with dtype auto made concrete."""
        return self if self.dtype != "auto" else replace(self, dtype="bfloat16")

    @property
    def torch_dtype(self) -> "torch.dtype":  # noqa: F821 - torch imported lazily
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype auto has no torch dtype before resolved() picks one")
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype]

    @property
    def kv_cache_dtype_name(self) -> str:
        """--kv-cache-dtype with auto made concrete (the serving dtype): what /get_server_info and the log show."""
        return self.resolved().dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def kv_torch_dtype(self) -> "torch.dtype":  # noqa: F821
        """The KV pool's storage dtype (torch.int8: the int8 layout of engine/ops/kv_quant.py)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        return {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
                "fp8_e4m3": torch.float8_e4m3fn}[self.kv_cache_dtype]
