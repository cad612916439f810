"""From API requests to engine inputs: prompt token ids (tokenized off the event loop) and SamplingParams."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.grammar.spec import GrammarSpec
from engine.sampling_params import SamplingParams
from server.api.errors import APIError
from server.api.protocol import ChatMessage, SamplingFields
from server.api.state import ServerState

T = TypeVar("T")


async def in_tokenizer_thread(state: ServerState, fn: Callable[..., T], *args: object) -> T:
    """Run tokenizer work on the tokenizer thread: a 100k-character prompt must not stall every stream."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, partial(fn, *args))


def encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them: text parts joined, `developer` read as `system`."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """`tools` (OpenAI function objects) go to the template's `tools` variable, for templates that render them."""
    return render_chat_prompt(tokenizer, messages, add_generation_prompt, tools)[0]


# apply_chat_template's own arguments: chat_template_kwargs may not set them (vLLM refuses them too).
_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "add_generation_prompt", "tokenize",
                                     "chat_template", "return_dict", "continue_final_message", "documents"})


def render_chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                       add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """(token ids, text) of the rendered prompt; `template_kwargs` (a request's chat_template_kwargs, e.g.
    Qwen3's enable_thinking) become template variables. The text tells where a reasoning output starts."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    extra = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_ARGS & extra.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    try:
        wrapped = None if tools is None else [{"type": "function", "function": t} for t in tools]
        text = str(tokenizer.apply_chat_template(messages, tools=wrapped, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra))
    except TemplateError as exc:  # e.g. "roles must alternate user/assistant"
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    # The template already holds any BOS token; adding special tokens again would double it.
    return encode(tokenizer, text, add_special_tokens=False), text


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    token_ids = [p for p in prompt if isinstance(p, int)]
    if token_ids:  # one prompt as token ids (the model guarantees the list is not mixed)
        return [token_ids]
    return [p if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    if not raw:
        return {}
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError as exc:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from exc


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


# What a field neither the request, the model nor the config file sets takes: OpenAI's defaults (top_k -1: off).
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_defaults(state: ServerState) -> dict[str, float]:
    """The values a request's unset temperature, top_p, top_k, min_p and repetition_penalty take: the model's
    recommended ones (--generation-config auto), then the config file's [sampling] table over them. Fields
    neither sets keep OpenAI's defaults (temperature 1, top_p 1, no top-k, min-p or penalty)."""
    settings = state.settings
    model: dict[str, float] = {}
    if settings.generation_config == "auto" and state.engine.ready:
        model = dict(state.engine.info.model_config.sampling_defaults)
    return {**model, **dict(settings.sampling_overrides)}


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                    max_n: int, grammar: GrammarSpec | None = None,
                    defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """Raises APIError for n over the limit and SamplingParamsError (-> 400 with its param) for bad ranges.
    `defaults` (see `sampling_defaults`) apply only to the fields the request left unset (or sent as null)."""
    d = defaults or {}
    n = _or(req.n, 1)
    if n > max_n:
        raise APIError(400, f"n must be at most {max_n} (--max-n)", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(req.temperature, d.get("temperature", 1.0)),
        top_p=_or(req.top_p, d.get("top_p", 1.0)),
        top_k=_or(req.top_k, int(d["top_k"]) if d.get("top_k", 0) > 0 else -1),  # HF and llama.cpp: 0 is off
        min_p=_or(req.min_p, d.get("min_p", 0.0)),
        repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        min_tokens=_or(req.min_tokens, 0),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        skip_special_tokens=req.skip_special_tokens,
        grammar=grammar,
    )
