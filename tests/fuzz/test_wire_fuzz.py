"""Every wire decoder under generated hostile input (issue 14, item 5, part 1).

The invariant (``trio_pd.core._wire`` module docstring): :func:`~trio_pd.core._wire.decode` either
returns a well-typed message that satisfies every documented bound, or raises
:class:`ProtocolError`; never anything else, and never slowly. A decoded message re-encodes
to frames that decode equal.

Volume comes from a plain loop over ``random.Random(seed)`` mutations (the ``full`` variant
draws 1,000,000 inputs); a smaller hypothesis set shrinks whatever it finds. Each class of
input is counted, with the slowest decode of its class; the figures go to the terminal and,
with ``TRIO_PD_FUZZ_REPORT=DIR``, to ``DIR/wire.json``.
"""

from __future__ import annotations

import copy
import os
import random
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_pd import ProtocolError
from trio_pd.core._wire import decode, encode

from ..helpers.wire import STRATEGIES, any_message, msgpack_values, mutate, mutations
from ._gen import (
    HOSTILE,
    TAGS,
    Base,
    ClassStats,
    Mutator,
    V,
    bound_violations,
    make_base,
    rand_message,
    report,
    round_trip_problem,
    show,
)

pytestmark = pytest.mark.fuzz

SEED = int(os.environ.get("TRIO_PD_FUZZ_SEED", "14005"))
INPUTS = {"short": 60_000, "full": 1_000_000}
HYPOTHESIS_EXAMPLES = {"short": 150, "full": 2_500}
#: no single input may take longer than this to decode or refuse (GC pauses included)
MAX_DECODE_S = 0.25


def corpus(rng: random.Random, n: int) -> list[Base]:
    return [make_base(*rand_message(rng)) for _ in range(n)]


def fuzz_decode(mutator: Mutator, n: int) -> tuple[dict[str, ClassStats], list[str]]:
    """Draw ``n`` inputs, decode each, check what comes back. Returns per-class figures and
    every problem found (an escaped exception, a bound broken, a failed round trip)."""
    stats = {name: ClassStats() for name in mutator.table}
    problems: list[str] = []
    clock = time.perf_counter_ns
    for i in range(n):
        name, frames = mutator.draw()
        s = stats[name]
        s.inputs += 1
        start = clock()
        try:
            msg, pages = decode(frames)
        except ProtocolError:
            s.add(clock() - start)
            s.refused += 1
            continue
        except Exception as exc:  # the bug this test is for
            s.add(clock() - start)
            s.escaped.append(f"#{i} {exc!r}: {show(frames)}")
            problems.append(f"{name} #{i}: decode raised {exc!r} for {show(frames)}")
            continue
        s.add(clock() - start)
        s.decoded += 1
        for why in bound_violations(msg, pages):
            problems.append(f"{name} #{i}: {why}: {show(frames)}")
        why_not = round_trip_problem(msg, pages)
        if why_not is not None:
            problems.append(f"{name} #{i}: {why_not}: {show(frames)}")
    return stats, problems


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("size", INPUTS)
def test_decode_survives_mutated_and_hostile_input(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    n = INPUTS[size]
    rng = random.Random(SEED)
    mutator = Mutator(rng, corpus(rng, 400), huge_every=500)
    start = time.perf_counter()
    stats, problems = fuzz_decode(mutator, n)
    took = time.perf_counter() - start
    total = sum(s.inputs for s in stats.values())
    slowest = max(stats.items(), key=lambda kv: kv[1].max_ns)
    table = {
        name: {
            "inputs": s.inputs, "decoded": s.decoded, "refused": s.refused,
            "escaped": len(s.escaped), "max_us": round(s.max_ns / 1000, 1),
            "mean_us": round(s.total_ns / max(s.inputs, 1) / 1000, 2),
        }
        for name, s in stats.items()
    }
    summary = {"seed": SEED, "inputs": total, "seconds": round(took, 1), "classes": table,
               "problems": problems[:50]}
    report(f"wire-{size}", summary)
    with capsys.disabled():
        print(f"\nwire fuzz ({size}): {total} inputs in {took:.1f} s, seed {SEED}")
        for name, row in table.items():
            print(f"  {name:16} {row}")
    assert total == n
    assert not problems, "\n".join(problems[:20])
    assert stats["valid"].refused == 0  # the control class: valid messages all decode
    assert all(s.inputs > 0 for s in stats.values())
    assert slowest[1].max_ns < MAX_DECODE_S * 1e9, slowest


# ------------------------------------------------------------------------ hypothesis


def _settings(size: str) -> settings:
    return settings(
        max_examples=HYPOTHESIS_EXAMPLES[size], deadline=None, database=None,
        suppress_health_check=list(HealthCheck), derandomize=True,
    )


def decode_checked(frames: list[Any]) -> None:
    try:
        msg, pages = decode(frames)
    except ProtocolError:
        return
    assert not bound_violations(msg, pages), bound_violations(msg, pages)
    assert round_trip_problem(msg, pages) is None, round_trip_problem(msg, pages)


hostile_values = st.sampled_from(HOSTILE) | msgpack_values
frame_ops = st.sampled_from(["none", "drop", "dup", "reverse", "append"])


@pytest.mark.parametrize("size", INPUTS)
def test_hypothesis_valid_messages_round_trip_within_bounds(size: str) -> None:
    @_settings(size)
    @given(any_message)
    def check(pair: tuple[Any, Any]) -> None:
        msg, pages = pair
        got, got_pages = decode(encode(msg, pages))
        assert got == msg
        assert not bound_violations(got, got_pages)
        assert round_trip_problem(got, got_pages) is None

    check()


@pytest.mark.parametrize("size", INPUTS)
def test_hypothesis_mutated_frames(size: str) -> None:
    @_settings(size)
    @given(any_message, st.lists(st.tuples(st.integers(0, 1), mutations), min_size=1,
                                 max_size=6), frame_ops, st.binary(max_size=16))
    def check(pair: tuple[Any, Any], hows: list[Any], op: str, extra: bytes) -> None:
        frames = encode(*pair)
        for which, how in hows:
            i = which % len(frames)
            frames[i] = mutate(frames[i], how)
        if op == "drop":
            frames.pop()
        elif op == "dup":
            frames.append(frames[0])
        elif op == "reverse":
            frames.reverse()
        elif op == "append":
            frames.append(extra)
        decode_checked(frames)

    check()


@pytest.mark.parametrize("size", INPUTS)
def test_hypothesis_hostile_fields(size: str) -> None:
    """Any field (of the header, or of a REGISTER's pool) set to any hostile value, removed,
    or joined by another; the tag and version included."""

    @_settings(size)
    @given(
        any_message,
        st.lists(
            st.tuples(
                st.sampled_from(["set", "delete", "set_pool"]),
                st.sampled_from(["t", "v", "room", "epoch", "endpoint", "rank", "nonce",
                                 "num_pages", "pool", "buffer_bases", "num_pages", "extra"]),
                hostile_values,
            ),
            min_size=1, max_size=4,
        ),
    )
    def check(pair: tuple[Any, Any], edits: list[tuple[str, str, Any]]) -> None:
        msg, pages = pair
        frames = encode(msg, pages)
        d = msgspec.msgpack.decode(frames[0])
        for action, key, value in edits:
            target = d["pool"] if action == "set_pool" and isinstance(d.get("pool"), dict) else d
            if action == "delete":
                target.pop(key, None)
            else:  # (a copy: a later edit of this header must not change HOSTILE's value)
                target[key] = copy.deepcopy(value)
        decode_checked([msgspec.msgpack.encode(d), *frames[1:]])

    check()


@pytest.mark.parametrize("size", INPUTS)
def test_hypothesis_random_headers(size: str) -> None:
    @_settings(size)
    @given(
        st.fixed_dictionaries(
            {"t": st.sampled_from(TAGS) | hostile_values, "v": st.just(V) | hostile_values},
            optional={k: hostile_values for k in ("room", "epoch", "rank", "nonce", "ok",
                                                  "endpoint", "reason", "num_pages", "pool")},
        ),
        st.lists(st.binary(max_size=32), max_size=2),
    )
    def check(header: dict[str, Any], rest: list[bytes]) -> None:
        decode_checked([msgspec.msgpack.encode(header), *rest])

    check()


@pytest.mark.parametrize("size", INPUTS)
def test_hypothesis_random_bytes(size: str) -> None:
    @_settings(size)
    @given(st.lists(st.binary(max_size=256), min_size=0, max_size=4))
    def check(frames: list[bytes]) -> None:
        decode_checked(frames)

    check()


def test_strategies_cover_every_type() -> None:
    assert set(STRATEGIES) == set(TAGS)
