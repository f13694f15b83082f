"""Pools and settings shared by the planners' tests, and one check on planned blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from trio_pd.core import _memory
from trio_pd.core._memory import PoolSpec

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: The hot-path helpers take lists up to ``_memory.SMALL`` elements and numpy above; these
#: tests' inputs are small, so each runs once per path with the threshold moved.
PATHS = pytest.mark.parametrize("path", ["lists", "numpy"])


@contextmanager
def on_path(path: str) -> Iterator[None]:
    saved = _memory.SMALL
    _memory.SMALL = saved if path == "lists" else -1
    try:
        yield
    finally:
        _memory.SMALL = saved


def make_pool(
    *,
    layout: Literal["mha", "mla"] = "mha",
    page_size: int = 4,
    num_pages: int = 8,
    num_layers: int = 2,
    head_bytes: int = 2,
    heads: int = 1,
    first_head: int = 0,
    base: int = 64,
    gap: int = 16,
    aux_item_len: int = 8,
    aux_slots: int = 4,
) -> PoolSpec:
    """Buffers laid out one after another from ``base`` with ``gap`` unused bytes between
    them (so a block that crosses a buffer edge lands in a gap and is noticed)."""
    item_len = page_size * heads * head_bytes
    num_buffers = 2 * num_layers if layout == "mha" else num_layers
    stride = num_pages * item_len + gap
    bases = tuple(base + i * stride for i in range(num_buffers))
    return PoolSpec(
        layout=layout,
        page_size=page_size,
        num_pages=num_pages,
        num_layers=num_layers,
        head_bytes=head_bytes,
        heads=heads,
        first_head=first_head,
        buffer_bases=bases,
        aux_base=base + num_buffers * stride,
        aux_item_len=aux_item_len,
        aux_slots=aux_slots,
    )



def assert_same_blocks(quick: Any, again: Any, want: Any) -> None:
    """A quick planner's blocks (``quick``, and ``again`` from other id dtypes) are the
    general path's (``want``) value for value, each array uint64."""
    assert want is not None and again is not None
    for got, ref, arr in zip(quick, want, again, strict=True):
        assert got.dtype == arr.dtype == np.uint64
        assert got.tolist() == ref.tolist() == arr.tolist()
