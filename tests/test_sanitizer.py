"""The lifetime sanitizer sees what it is there to see (issue: lifetimes, item 8).

With the per-chunk drain broken (engine calls abandoned on abort, so a chunk ends while its
write is still on its way), the demo's allocators must report late writes; with the real
code, the same run reports none.
"""

from __future__ import annotations

import pytest

from trio_pd.tools._demo import DemoOptions, run_in_process

from .helpers.faults import break_the_drain

# Small delayed writes on every call and many aborts: aborts land while writes are in flight.
OPTS = DemoOptions(
    requests=150, concurrency=4, abort_rate=0.5, fault_rate=1.0,
    fault_kinds=("delay_before",), fault_delay=0.005, max_tokens=512, seed=0,
)


async def test_real_drain_has_no_late_writes() -> None:
    summary = await run_in_process(OPTS)
    assert summary["aborted"] > 0
    assert summary["late_writes"] == 0
    assert summary["corrupt_pages"] == 0


async def test_sanitizer_catches_a_broken_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    break_the_drain(monkeypatch)
    summary = await run_in_process(OPTS)
    assert summary["late_writes"] + summary["corrupt_pages"] > 0, summary


def test_end_of_run_audit_sees_a_write_into_a_free_row() -> None:
    """A late write into a page nobody allocated again is still counted at the end."""
    import numpy as np

    from trio_pd.testing.pools import DEST_POISON, PageAllocator

    rows = np.zeros((4, 2, 8), dtype=np.uint8)
    alloc = PageAllocator(rows, DEST_POISON)
    ids = alloc.alloc_nowait(2)
    assert ids is not None
    alloc.free(ids)
    assert alloc.late_in_free_rows() == 0
    rows[int(ids[0]), 1, 3] = 7  # the engine writes after the release
    assert alloc.late_in_free_rows() == 1
    assert alloc.free_count == 4 and alloc.late_writes == 0  # the audit changes nothing
