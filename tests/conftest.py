"""Shared fixtures: tiny random HF model folders, the real SmolLM2 GGUF with its transformers oracle, its tokenizer."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The harnesses and tiny-model writers in tests/support are imported by name from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from server_harness import TINY_CONTEXT, Server, http_client, openai_client, tiny_server
from tiny_models import write_tiny_model

if TYPE_CHECKING:
    import llguidance

MakeTinyModel = Callable[..., Path]
SmolLM2Oracle = tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_cache() -> None:
    """Each test module starts with dynamo's caches empty. The compiled decode step is one code object, compiled
    once per bucket and model; a server compiles one model, but the suite compiles dozens in one process, which
    went past dynamo's recompile limit once the Phi-3 and MoE tests were added."""
    import torch._dynamo

    torch._dynamo.reset()


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> MakeTinyModel:
    """`make_tiny_model(arch, **overrides) -> Path`: a tiny random HF folder (safetensors, tokenizer with a
    ChatML template, generation_config.json).

    arch: llama | llama3 (llama with llama3 rope scaling) | mistral | qwen2 | qwen3. 2 layers, hidden 64,
    4 heads of 16, 2 KV heads, vocab 320, fp32, seed 0. Overrides are config kwargs (e.g.
    tie_word_embeddings=True), plus `seed` and `max_shard_size` (e.g. "100KB" for a sharded folder).
    Folders are built once per session per argument set: treat them as read-only.
    """
    built: dict[str, Path] = {}

    def make(arch: str, **overrides: Any) -> Path:
        key = f"{arch}-" + "-".join(f"{k}={overrides[k]!r}" for k in sorted(overrides))
        if key not in built:
            folder = tmp_path_factory.mktemp(arch) / arch
            built[key] = write_tiny_model(folder, arch, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_hf_fp32() -> SmolLM2Oracle:
    """(transformers model, tokenizer, gguf path) for the embedded SmolLM2-135M-Instruct, dequantized to fp32.

    The model is the oracle: transformers' own GGUF conversion (load_gguf_checkpoint, the code
    `from_pretrained(dir, gguf_file=..., quantization_config=GgufConfig(dequantize=True))` runs) loaded into a
    plain LlamaForCausalLM. We call it directly because from_pretrained insists on `accelerate` for any GGUF;
    the tensors are identical (checked with accelerate installed aside). The tokenizer is our
    engine.loader.load_tokenizer, loaded once here because it takes seconds.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.loader import default_model_path, load_tokenizer

    path = Path(default_model_path())
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied embeddings: lm_head is the embedding Parameter itself, absent from the file.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    return model, load_tokenizer(str(path)), path


@pytest.fixture(scope="session")
def tok() -> PreTrainedTokenizerBase:
    """The embedded SmolLM2-135M-Instruct GGUF's tokenizer and ChatML template (the tool and grammar tests)."""
    from engine.loader import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def ll(tok: PreTrainedTokenizerBase) -> llguidance.LLTokenizer:
    """llguidance's view of `tok`, for checking grammars token by token."""
    import llguidance.hf
    return llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))


# A real `ember serve` over a tiny model, one per test module that asks for it (tests/server_harness.py).
@pytest.fixture(scope="module")
def server(make_tiny_model: MakeTinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)
    with tiny_server(model, tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with http_client(server) as c:
        yield c


DEPLOY = Path(__file__).resolve().parent / "deploy"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/deploy (container, router, Kubernetes, soak) carries the `deploy` marker, so the fast
    loop (`make test-fast`: -m "not slow and not deploy") leaves it out without each file having to say so."""
    for item in items:
        if DEPLOY in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.deploy)
