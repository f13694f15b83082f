"""The ``open_*`` context managers raise one error, as the docs promise, not ExceptionGroups.

Every example nests ``open_prefill`` / ``open_decode`` inside ``open_bootstrap_server()``, and
each of them owns a nursery, so without a boundary a ``ConfigurationError`` from
``open_prefill``, a failed registration, or the caller's own exception came out wrapped in
(nested) groups that ``except ConfigurationError`` misses. The rule (``trio_pd.core._errors.
one_error``): the caller's exception comes out as itself; one error of ours becomes that
error, raised from the group; unrelated failures stay a group. The real engine, the real
bootstrap service; the thread and asyncio facades too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio

from trio_pd import (
    BootstrapError,
    ConfigurationError,
    DecodeConfig,
    EngineError,
    PrefillConfig,
    open_bootstrap_server,
    open_decode,
    open_prefill,
    sync,
)
from trio_pd.aio import open_trio_host
from trio_pd.core._errors import one_error
from trio_pd.engines import ClosingEngine, make_engine

from .helpers.agents import host_pool

#: a short bootstrap deadline: a refused registration must not wait out the default one
QUICK = PrefillConfig(bootstrap_timeout=5.0)


class Mine(Exception):
    """The caller's own error, raised in the block."""


@pytest.fixture
def engine() -> Iterator[ClosingEngine]:
    with make_engine("mooncake") as engine:
        yield engine


async def test_configuration_error_nested_in_the_bootstrap_block_is_itself(
    engine: ClosingEngine,
) -> None:
    """The README's nesting: a ``kv_heads`` that does not fit the pool raises
    ConfigurationError itself, caught by ``except ConfigurationError`` (before: an
    ExceptionGroup from the bootstrap server's nursery)."""
    pool = host_pool()
    with pytest.raises(ConfigurationError, match="kv_heads=3"):
        async with (
            open_bootstrap_server() as boot,
            open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url, kv_heads=3),
        ):
            pytest.fail("the block ran")


async def test_the_callers_exception_comes_out_of_nested_blocks_as_itself(
    engine: ClosingEngine,
) -> None:
    """The block's own exception leaves ``open_bootstrap_server``, ``open_prefill`` and
    ``open_decode`` as the same object, with its own context and no group around it."""
    src, dst = host_pool(), host_pool()
    raised = Mine("the handler failed")
    with pytest.raises(Mine) as info:
        async with (
            open_bootstrap_server() as boot,
            open_prefill(engine=engine, pool=src.spec, bootstrap_url=boot.url),
            open_decode(engine=engine, pool=dst.spec),
        ):
            raise raised
    assert info.value is raised
    assert raised.__context__ is None and raised.__cause__ is None


async def test_a_refused_registration_is_one_bootstrap_error_from_its_group(
    engine: ClosingEngine,
) -> None:
    """A start that fails inside ``open_prefill``'s nursery (the service refuses the
    token) raises that BootstrapError, copied and raised ``from`` the group that holds the
    original with its traceback."""
    pool = host_pool()
    async with open_bootstrap_server(token="the-cluster-token") as boot:
        with pytest.raises(BootstrapError, match="401") as info:
            async with open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url,
                                    token="another-token", config=QUICK):
                pytest.fail("the block ran")
    group = info.value.__cause__
    assert isinstance(group, BaseExceptionGroup)
    assert group.subgroup(BootstrapError) is not None


# ------------------------------------------------------------------ the rule itself


@one_error
@asynccontextmanager
async def _serving(fail: BaseException | None = None) -> AsyncIterator[trio.Event]:
    """A context manager shaped like ``open_prefill``: a nursery with a background task
    that raises ``fail`` once the returned event is set."""
    go = trio.Event()

    async def background() -> None:
        await go.wait()
        if fail is not None:
            raise fail
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(background)
        try:
            yield go
        finally:
            nursery.cancel_scope.cancel()


async def test_one_background_failure_is_a_copy_raised_from_the_group() -> None:
    """The error's type and attributes are kept (an EngineError's ``code``)."""
    failed = EngineError("the engine failed", code=-1)
    with pytest.raises(EngineError, match="the engine failed") as info:
        async with _serving(failed) as go:
            go.set()
            await trio.sleep_forever()
    assert info.value.code == -1
    assert isinstance(info.value.__cause__, BaseExceptionGroup)
    assert info.value.__cause__.exceptions == (failed,)


async def test_the_callers_error_beside_a_background_failure_stays_a_group() -> None:
    """Two unrelated failures are not folded into one."""
    failed = EngineError("the engine failed")

    async def block() -> None:
        async with _serving(failed) as go:
            go.set()
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # the background task fails meanwhile
            raise Mine("the handler failed too")

    with pytest.RaisesGroup(Mine, EngineError, flatten_subgroups=True):
        await block()


async def test_a_cancellation_of_the_block_comes_out_as_itself() -> None:
    """The block's Cancelled (the caller's own deadline) is the caller's exception: it
    comes out as the Cancelled it is, and the caller's scope catches it."""

    @one_error
    @asynccontextmanager
    async def idle() -> AsyncIterator[None]:
        async with trio.open_nursery():
            yield

    seen: list[BaseException] = []
    with trio.move_on_after(0.01) as scope:
        try:
            async with idle():
                await trio.sleep_forever()
        except BaseException as exc:
            seen.append(exc)
            raise
    assert scope.cancelled_caught
    assert [type(exc) for exc in seen] == [trio.Cancelled]


async def test_a_lone_keyboard_interrupt_of_ours_is_left_in_its_group() -> None:
    """Only ``Exception``s are copied: a KeyboardInterrupt (or Cancelled) from a task of
    ours stays the group trio made, for ``trio.run`` and cancel scopes to handle."""
    interrupt = KeyboardInterrupt()
    with pytest.raises(BaseExceptionGroup) as info:
        async with _serving(interrupt) as go:
            go.set()
            await trio.sleep_forever()
    assert info.value.exceptions == (interrupt,)


async def test_an_exception_the_opener_swallows_is_not_raised_again() -> None:
    """What the wrapped context manager suppresses stays suppressed."""

    @one_error
    @asynccontextmanager
    async def forgiving() -> AsyncIterator[None]:
        try:
            yield
        except Mine:
            pass

    async with forgiving():
        raise Mine("forgiven")


# ------------------------------------------------------------------ the facades


def test_thread_facade_raises_the_start_error_itself(engine: ClosingEngine) -> None:
    pool = host_pool()
    with sync.open_bootstrap_server(token="the-cluster-token") as boot:
        with pytest.raises(BootstrapError, match="401"):
            sync.open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url,
                              token="another-token", config=QUICK)
        with pytest.raises(ConfigurationError, match="kv_heads=3"):
            sync.open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url,
                              kv_heads=3)


def test_asyncio_facade_raises_the_start_error_itself(engine: ClosingEngine) -> None:
    """(Before: the refused registration came out of ``host.open_prefill`` as an
    ExceptionGroup.)"""
    pool = host_pool()

    async def main() -> None:
        async with (
            open_trio_host() as host,
            host.open_bootstrap_server(token="the-cluster-token") as boot,
        ):
            with pytest.raises(BootstrapError, match="401"):
                async with host.open_prefill(
                    engine=engine, pool=pool.spec, bootstrap_url=boot.url,
                    token="another-token", config=QUICK,
                ):
                    pytest.fail("the block ran")

    asyncio.run(main())


_NAN = float("nan")

#: (field, bad value, what the message names besides the field): each knob of PrefillConfig
#: given a value of the wrong type or out of its range
PREFILL_BAD = [
    ("workers", 0, "int >= 1"), ("workers", 2.5, "int >= 1"), ("workers", None, "int >= 1"),
    ("workers", True, "int >= 1"),
    ("inflight_per_peer", 0, "int >= 1"), ("inflight_per_peer", "2", "int >= 1"),
    ("coalesce_pages", 0, "int >= 1"), ("coalesce_pages", 64.0, "int >= 1"),
    ("batch_blocks", -1, "int >= 0"), ("batch_blocks", None, "int >= 0"),
    ("batch_bytes", -1, "int >= 0"), ("batch_bytes", 1e6, "int >= 0"),
    ("staging_bytes", -5, "int >= 0"), ("staging_bytes", 64e6, "int >= 0"),
    ("lane_nice", -1, "int >= 0"), ("lane_nice", "10", "int >= 0"),
    ("bootstrap_timeout", -1, "seconds"), ("bootstrap_timeout", _NAN, "seconds"),
    ("bootstrap_timeout", None, "seconds"), ("bootstrap_timeout", "30", "seconds"),
    ("quarantine_fence", -1.0, "seconds"), ("quarantine_fence", _NAN, "seconds"),
    ("close_timeout", -1.0, "seconds"), ("close_timeout", "1", "seconds"),
    ("tombstone_ttl", -1, "seconds"), ("tombstone_ttl", None, "seconds"),
    ("sndhwm", -1, "int >= 0"), ("sndhwm", 1e4, "int >= 0"),
    ("max_pending_meta", 0, "int >= 1"), ("max_pending_meta", None, "int >= 1"),
    ("max_pending_page_ids", 0, "int >= 1"), ("max_pending_page_ids", 1.5, "int >= 1"),
    ("failed_status_retry", -1, "seconds"), ("failed_status_retry", _NAN, "seconds"),
    ("max_peer_sockets", 0, "int >= 1"), ("max_peer_sockets", "512", "int >= 1"),
    ("peer_socket_idle", 0, "seconds > 0"), ("peer_socket_idle", _NAN, "seconds > 0"),
    ("max_decode_peers", 0, "int >= 1"), ("max_decode_peers", None, "int >= 1"),
    ("peer_idle_timeout", -1, "seconds"), ("peer_idle_timeout", _NAN, "seconds"),
]

#: the same for DecodeConfig
DECODE_BAD = [
    ("bootstrap_timeout", -1, "seconds"), ("bootstrap_timeout", _NAN, "seconds"),
    ("bootstrap_timeout", "30", "seconds"),
    ("waiting_timeout", -1, "seconds"), ("waiting_timeout", None, "seconds"),
    ("ack_timeout", -1, "seconds"), ("ack_timeout", _NAN, "seconds"),
    ("heartbeat_interval", 0, "seconds > 0"), ("heartbeat_interval", None, "seconds > 0"),
    ("heartbeat_interval", _NAN, "seconds > 0"),
    ("heartbeat_misses", 0, "int >= 1"), ("heartbeat_misses", 2.5, "int >= 1"),
    ("release_policy", "eager", "'drain' or 'timeout'"),
    ("release_policy", None, "'drain' or 'timeout'"),
    ("close_timeout", -1, "seconds"), ("close_timeout", "10", "seconds"),
    ("sndhwm", -1, "int >= 0"), ("sndhwm", None, "int >= 0"),
    ("abort_retry", -1, "seconds"), ("abort_retry", _NAN, "seconds"),
    ("max_peer_sockets", 0, "int >= 1"), ("max_peer_sockets", 512.0, "int >= 1"),
    ("peer_socket_idle", 0, "seconds > 0"), ("peer_socket_idle", "300", "seconds > 0"),
    ("landing_bytes", -1, "int >= 0"), ("landing_bytes", 64e6, "int >= 0"),
    ("landing_below", -1, "int >= 0"), ("landing_below", 256e3, "int >= 0"),
]


def _case_id(case: tuple[str, object, str]) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("case", PREFILL_BAD, ids=_case_id)
async def test_a_bad_prefill_knob_is_a_configuration_error_naming_it(
    engine: ClosingEngine, case: tuple[str, object, str]
) -> None:
    """Each PrefillConfig knob of the wrong type or out of range is a ConfigurationError from
    ``open_prefill``, before anything starts, naming the field, its range and the value; not
    a TypeError or ValueError from deep inside later, nor quietly taken."""
    name, bad, fragment = case
    config = dataclasses.replace(PrefillConfig(bootstrap_timeout=5.0), **{name: bad})
    with trio.fail_after(10), pytest.raises(ConfigurationError) as info:
        async with open_prefill(engine=engine, pool=host_pool().spec,
                                bootstrap_url="http://127.0.0.1:9", config=config):
            pytest.fail("the block ran")
    assert f"{name} must be" in str(info.value)
    assert fragment in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("case", DECODE_BAD, ids=_case_id)
async def test_a_bad_decode_knob_is_a_configuration_error_naming_it(
    engine: ClosingEngine, case: tuple[str, object, str]
) -> None:
    """The same for each DecodeConfig knob, from ``open_decode``."""
    name, bad, fragment = case
    config = dataclasses.replace(DecodeConfig(), **{name: bad})
    with trio.fail_after(10), pytest.raises(ConfigurationError) as info:
        async with open_decode(engine=engine, pool=host_pool().spec, config=config):
            pytest.fail("the block ran")
    assert f"{name} must be" in str(info.value)
    assert fragment in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_documented_edge_values_of_the_knobs_still_open(
    engine: ClosingEngine, side: str
) -> None:
    """The edges the docstrings give keep working: 0 for "off" sizes, None for the derived
    prefill deadlines, an int where seconds are asked, infinity for a deadline."""
    pool = host_pool()
    async with open_bootstrap_server() as boot:
        if side == "prefill":
            pc = PrefillConfig(batch_blocks=0, staging_bytes=0, lane_nice=0, coalesce_pages=1,
                               bootstrap_timeout=5, quarantine_fence=None, close_timeout=None,
                               tombstone_ttl=float("inf"), sndhwm=0)
            async with open_prefill(engine=engine, pool=pool.spec, bootstrap_url=boot.url,
                                    config=pc):
                pass
        else:
            dc = DecodeConfig(landing_bytes=0, landing_below=0, release_policy="timeout",
                              waiting_timeout=float("inf"), close_timeout=0, sndhwm=0,
                              heartbeat_interval=1)
            async with open_decode(engine=engine, pool=pool.spec, config=dc):
                pass
