"""UTF-8 text deltas on the real SmolLM2: emoji and CJK characters come out of the byte-level BPE in pieces
(one character over two or three tokens), and the stream must never show a half character."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty

pytestmark = pytest.mark.slow
REPLACEMENT = "\ufffd"
QUESTIONS = ["Repeat exactly: 🎉🔥 café 日本", "Translate to Japanese: good morning, café ☕"]


@pytest.fixture(scope="module")
def core(smollm2_hf_fp32: tuple[Any, Any, Path]) -> EngineCore:
    _, tok, path = smollm2_hf_fp32
    config = EngineConfig(model=str(path), dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          decode_buckets=(1, 2, 4), disable_compile=True, num_threads=1)
    return EngineCore(config, tokenizer=tok)


def test_multibyte_characters_stream_whole(core: EngineCore) -> None:
    tok = core.tokenizer
    arrivals = [
        Arrival(i, f"q{i}", list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)),
                SamplingParams(temperature=0.0, max_tokens=40))
        for i, q in enumerate(QUESTIONS)
    ]
    streams = Driver(core).run(arrivals)
    split_chars = 0
    for a in arrivals:
        st = streams[(a.request_id, 0)]
        full = tok.decode(st.token_ids, skip_special_tokens=True)
        assert st.text == full
        # A stream cut by max_tokens inside a character ends in U+FFFD, as decode() does; never before the end.
        assert all(REPLACEMENT not in d for d in st.deltas[:-1]), st.deltas
        assert REPLACEMENT not in st.deltas[-1] or full.endswith(REPLACEMENT)
        split_chars += sum(REPLACEMENT in tok.decode([t]) for t in st.token_ids)
        assert any(ord(ch) > 0x7FF for ch in st.text)  # 3- and 4-byte characters really were streamed
    assert split_chars > 5  # tokens that are only part of a character: the case under test
    assert "🔥" in streams[("q0", 0)].text
    assert_idle_and_empty(core)
