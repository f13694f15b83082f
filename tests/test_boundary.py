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
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio

from trio_pd import (
    BootstrapError,
    ConfigurationError,
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
