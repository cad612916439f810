"""engine/huge_pages.py: the weights' memory asked into 2 MiB pages, contents unchanged."""
from __future__ import annotations

import pytest
import torch

from conftest import MakeTinyModel
from engine import huge_pages
from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.model_runner import ModelRunner

needs_thp = pytest.mark.skipif(huge_pages.thp_mode() in ("never", "unavailable"),
                               reason=f"transparent huge pages are {huge_pages.thp_mode()} on this kernel")


def skip_unless_collapsed(collapsed: int, refused: int) -> None:
    """Skip where the kernel could not collapse pages now: no MADV_COLLAPSE, or no free 2 MiB page to collapse into."""
    if refused:
        pytest.skip(f"the kernel found no free 2 MiB page for {refused >> 20} MiB (memory fragmented): MADV_COLLAPSE "
                    "returned EAGAIN/ENOMEM, so the collapse could not be checked")
    if collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1): pages become huge only as khugepaged runs")


@needs_thp
def test_advise_collapses_a_tensor_into_huge_pages_and_keeps_its_values() -> None:
    n = 24 << 20  # 24 MiB: at least 11 whole 2 MiB pages whatever the alignment
    t = torch.randint(-128, 127, (n,), dtype=torch.int8)
    want = t.clone()
    before = huge_pages.process_huge_page_bytes()
    asked, collapsed, refused = huge_pages.advise([t, t[: n // 2]])  # a view of the same storage is asked for once
    assert 11 * huge_pages.HUGE_PAGE <= asked <= n
    assert torch.equal(t, want)
    skip_unless_collapsed(collapsed, refused)
    assert collapsed == asked
    assert huge_pages.process_huge_page_bytes() - before >= collapsed - 4 * huge_pages.HUGE_PAGE


def test_small_and_non_cpu_tensors_are_left_alone() -> None:
    assert huge_pages.advise([torch.ones(1000), torch.ones(1 << 20, device="meta")]) == (0, 0, 0)


@needs_thp
def test_a_loaded_model_runs_on_huge_pages(make_tiny_model: MakeTinyModel) -> None:
    """ModelRunner asks for its weights' pages: the process then holds at least their whole 2 MiB pages huge."""
    folder = make_tiny_model("llama", intermediate_size=16384)  # gate|up: 32768 x 64 fp32, 8 MiB
    runner = ModelRunner(EngineConfig(model=str(folder), dtype="float32", max_total_tokens=256, max_running_requests=1,
                                      decode_buckets=(1,), disable_compile=True), open_checkpoint(str(folder)))
    weights = list(runner.model.parameters()) + list(runner.model.buffers())
    big = sum(e - s for s, e in huge_pages._spans(weights))
    assert big >= 3 * huge_pages.HUGE_PAGE
    held = huge_pages.process_huge_page_bytes()
    if held < big:  # the kernel's reasons for not collapsing now, if it had any (else ModelRunner did not ask)
        _, collapsed, refused = huge_pages.advise(weights)
        skip_unless_collapsed(collapsed, refused)
    assert held >= big
