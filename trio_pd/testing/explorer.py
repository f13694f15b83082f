"""A stateless model checker for trio: run a small scenario under every task schedule.

trio runs tasks in *batches*. At each pass of its run loop it takes every task that is
runnable right now, orders them, and steps each one in that order until its next
checkpoint; a task woken during the pass waits for the next batch. So the only freedom the
scheduler has -- the only source of interleavings in an I/O-free program -- is the order of
the tasks within each batch. (With ``MockClock(autojump_threshold=0)`` time moves only when
every task is blocked, and then it jumps straight to the next deadline, so sleeps cost
nothing and add no freedom.)

:func:`explore` runs ``scenario`` again and again, each time steering those orders from a
*choice vector*, and enumerates the vectors depth first so that every distinct schedule is
visited exactly once:

- A batch of ``k`` tasks (sorted by spawn order first, so the same program state gives the
  same list) is turned into a run order by ``k - 1`` decisions: "which of the ``k`` remaining
  tasks runs next", then which of the ``k - 1`` left, and so on. Each decision appends one
  entry to the choice vector and records its branching factor. Choice ``0`` always means
  "the earliest-spawned task that is left", so the first schedule explored is the FIFO one.
- After a run, the next vector is the previous one up to its last decision that has an
  untried alternative, with that decision incremented; decisions past the prefix default to
  ``0``. When no decision has an alternative left, the tree is done: ``exhaustive=True``.

trio's own tasks (the root task, and the run_sync_soon task it starts next to the
scenario) touch no scenario state, so they are stepped first in their batches instead of
being permuted: permuting them would only multiply every schedule by orders that look the
same to the scenario. (The one exception: callbacks a scenario queues with
``TrioToken.run_sync_soon`` run at that fixed position. Tasks a scenario starts with
``spawn_system_task`` are permuted like any other.)

By default every *permutation* of the scenario's tasks in every batch is explored: every
order trio's deterministic scheduler could pick, up to the placement of its own tasks. So an
exhaustive run means no schedule trio can produce violates the scenario's invariant. (trio's
normal scheduler only ever runs a batch forwards or reversed, a subset of these.)
``first_only=True`` enumerates only which task of a batch runs *first* and keeps the rest in
spawn order: ``k`` branches per batch instead of ``k!``. That still lets every pair of tasks
in a batch run in either order -- enough for the two-party races (check-then-act, lost
update, publish-versus-abort) these scenarios are about -- but it misses orders of three or
more tasks, so "exhaustive" then means exhaustive over that smaller space. A
:class:`Schedule` records which space it came from.

A schedule in which every task is blocked with nothing left to wake it fails with
:class:`Deadlock`; one that never stops running (tasks spinning on checkpoints) is
cancelled after a bounded number of batches and fails with :class:`Livelock`.

The explorer patches module globals of trio for the duration of each run and restores them
afterwards. It is not thread-safe, and must not be called from inside ``trio.run`` (it calls
``trio.run`` itself): use it from plain synchronous tests.
"""

from __future__ import annotations

import importlib
import random
import warnings
from collections.abc import Awaitable, Callable, Iterator, MutableSequence, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import trio
import trio.testing

__all__ = [
    "CHECKED_TRIO",
    "Deadlock",
    "ExplorationResult",
    "Failure",
    "Livelock",
    "Schedule",
    "ScheduleMismatch",
    "TrioVersionWarning",
    "assert_all_schedules",
    "explore",
    "hook_available",
    "replay",
]

Scenario = Callable[[], Awaitable[object]]

# --- trio internals -------------------------------------------------------------------------
# These are private names of trio._core._run. trio has exposed them (for its Hypothesis
# plugin) for years, but they are not API: the explorer was checked against trio
# CHECKED_TRIO, says so (_check_trio) when it runs on another minor version, and
# hook_available() exists and a canary test calls it.
#
# With _ALLOW_DETERMINISTIC_SCHEDULING true, each pass of the run loop does
#     batch = list(runner.runq); batch.sort(key=lambda t: t._counter); _r.shuffle(batch)
# and then runs ``batch.pop()`` until the batch is empty: the LAST element runs first.
# With it false, trio calls ``_r.random() < 0.5`` to decide whether to reverse the batch.
# The only other use of _r is ``_r.uniform`` for SystemClock's offset (unused under
# MockClock). Our driver is a seeded random.Random, so every call other than shuffle() is
# deterministic too.
_RUN_MODULE = "trio._core._run"
#: the trio minor version whose private scheduling hook the explorer was checked against
CHECKED_TRIO = "0.35"
_FLAG = "_ALLOW_DETERMINISTIC_SCHEDULING"
_RANDOM = "_r"

# A schedule in which the virtual clock gets this far has had every task blocked with no
# deadline to wake it (autojump only moves the clock when all tasks are blocked).
_DEADLOCK_HORIZON_S = 24 * 3600.0
# A run that needs more batches than this is cancelled and reported as a livelock.
_MAX_BATCHES = 10_000


class Deadlock(Exception):
    """Every task of the scenario was blocked, with nothing left that could wake one."""


class Livelock(Exception):
    """The scenario kept running (tasks spinning on checkpoints) without ever finishing."""


class ScheduleMismatch(RuntimeError):
    """A choice vector did not fit the scenario's decisions.

    From :func:`replay`: the schedule was recorded from a different scenario (or a different
    version of it). From :func:`explore`: the scenario is not deterministic -- the same
    choices led to batches of different sizes (it depends on something other than the
    schedule: wall-clock time, global state left by an earlier run, hash order of ``id``).
    """


@dataclass(frozen=True)
class Schedule:
    """One schedule, replayable with :func:`replay`.

    ``choices[i]`` is the i-th scheduling decision of the run: the index, among the tasks of
    the current batch not yet ordered (in spawn order), of the one that runs next.
    ``first_only`` says whether only the first task of each batch was chosen (see the module
    docstring).
    """

    choices: tuple[int, ...]
    first_only: bool = False


@dataclass(frozen=True)
class Failure:
    """A schedule under which the scenario raised, and what it raised."""

    schedule: Schedule
    exception: BaseException


@dataclass(frozen=True)
class ExplorationResult:
    """What :func:`explore` did: how many schedules it ran, whether that was all of them,
    and the schedules that failed."""

    schedules_run: int
    exhaustive: bool
    failures: list[Failure]


def _run_module() -> ModuleType:
    return importlib.import_module(_RUN_MODULE)


def hook_available() -> bool:
    """Whether the installed trio still has the private scheduling hook the explorer uses.

    This is the canary: a trio upgrade that moves or renames the hook makes it False (and
    the explorer itself also raises if its driver is never consulted during a run).
    """
    try:
        mod = _run_module()
    except ImportError:
        return False
    flag = getattr(mod, _FLAG, None)
    rng = getattr(mod, _RANDOM, None)
    return (
        isinstance(flag, bool)
        and isinstance(rng, random.Random)
        and callable(getattr(rng, "shuffle", None))
    )


class TrioVersionWarning(RuntimeWarning):
    """The explorer runs on a trio minor version other than :data:`CHECKED_TRIO`."""


def _check_trio() -> None:
    """Warn (:class:`TrioVersionWarning`) on a trio other than the one the explorer was
    checked against, and raise ``RuntimeError`` if that trio lacks the hook altogether.
    Called each time :func:`explore` or :func:`replay` starts, not at import."""
    installed = trio.__version__
    if ".".join(installed.split(".")[:2]) == CHECKED_TRIO:
        return
    if not hook_available():
        raise RuntimeError(
            f"trio_pd.testing's schedule explorer was checked against trio {CHECKED_TRIO}, and "
            f"trio {installed} no longer has the private scheduling hook it uses "
            f"({_RUN_MODULE}.{_FLAG}, {_RANDOM}): install trio=={CHECKED_TRIO}.*"
        )
    warnings.warn(
        f"trio_pd.testing's schedule explorer was checked against trio {CHECKED_TRIO}, but "
        f"trio {installed} is installed: it drives trio's private scheduling hook, which "
        f"is still there, but its results are unverified on this version",
        TrioVersionWarning,
        stacklevel=3,
    )


class _Driver(random.Random):
    """Stands in for trio's module-level Random: orders each batch from a choice vector."""

    def __init__(
        self,
        prefix: Sequence[int],
        expected_branching: Sequence[int] | None,
        *,
        first_only: bool,
    ) -> None:
        super().__init__(0)
        self._prefix = tuple(prefix)
        self._expected = None if expected_branching is None else tuple(expected_branching)
        self._first_only = first_only
        self.decisions: list[int] = []
        self.branching: list[int] = []
        self.batches = 0
        self.mismatch: str | None = None
        self.livelocked = False
        self.cancel_scope: trio.CancelScope | None = None
        self._own: frozenset[trio.lowlevel.Task] | None = None

    def _choose(self, n: int) -> int:
        pos = len(self.decisions)
        choice = 0
        if pos < len(self._prefix) and self.mismatch is None:
            choice = self._prefix[pos]
            if self._expected is not None and self._expected[pos] != n:
                self.mismatch = (
                    f"decision {pos} had {self._expected[pos]} alternatives before and {n} now"
                )
                choice = 0
            elif choice >= n:
                self.mismatch = f"decision {pos} is {choice} but has only {n} alternatives"
                choice = 0
        self.decisions.append(choice)
        self.branching.append(n)
        return choice

    def _trio_own_tasks(self) -> frozenset[trio.lowlevel.Task]:
        """trio's own tasks: the root task and whatever it started next to our main task
        before any scenario code ran (the run_sync_soon task). Found with public API only."""
        if self._own is not None:
            return self._own
        root = trio.lowlevel.current_root_task()
        if root is None:
            return frozenset()
        siblings = [task for nursery in root.child_nurseries for task in nursery.child_tasks]
        if not siblings:
            # The first batch: only the root task exists yet.
            return frozenset({root})
        self._own = frozenset(
            {
                root,
                *(
                    task
                    for task in siblings
                    if getattr(task.coro, "cr_code", None) is not _MAIN_CODE
                ),
            }
        )
        return self._own

    def shuffle(self, x: MutableSequence[Any]) -> None:
        self.batches += 1
        if self.batches > _MAX_BATCHES and not self.livelocked:
            self.livelocked = True
            if self.cancel_scope is not None:
                # Called from the run loop between task steps; cancel() only marks tasks
                # for wake-up in a later batch, which is safe here.
                self.cancel_scope.cancel()
        own = self._trio_own_tasks()
        order = [t for t in x if t in own]
        pending = [t for t in x if t not in own]
        while len(pending) > 1:
            order.append(pending.pop(self._choose(len(pending))))
            if self._first_only:
                break
        order.extend(pending)
        # trio runs the batch by popping from the end.
        order.reverse()
        x[:] = order


@contextmanager
def _driving(driver: _Driver) -> Iterator[None]:
    mod = _run_module()
    saved_rng = getattr(mod, _RANDOM)
    saved_flag = getattr(mod, _FLAG)
    setattr(mod, _RANDOM, driver)
    setattr(mod, _FLAG, True)
    try:
        yield
    finally:
        setattr(mod, _RANDOM, saved_rng)
        setattr(mod, _FLAG, saved_flag)


async def _main(scenario: Scenario, driver: _Driver) -> None:
    with trio.move_on_after(_DEADLOCK_HORIZON_S) as cs:
        driver.cancel_scope = cs
        await scenario()
    if driver.livelocked:
        raise Livelock(f"the scenario was still running after {_MAX_BATCHES} batches")
    if cs.cancelled_caught:
        raise Deadlock(
            f"every task was blocked with nothing to wake it (virtual clock reached "
            f"{_DEADLOCK_HORIZON_S:g} s)"
        )


_MAIN_CODE = _main.__code__


def _run_once(scenario: Scenario, driver: _Driver) -> BaseException | None:
    """Run the scenario once under ``driver``; return what it raised, or None."""
    error: BaseException | None = None
    with _driving(driver):
        try:
            trio.run(_main, scenario, driver, clock=trio.testing.MockClock(autojump_threshold=0))
        except Exception as exc:
            # Not BaseException: KeyboardInterrupt and SystemExit are the user's, not the
            # scenario's; Cancelled cannot escape trio.run.
            error = exc
    if driver.batches == 0:
        raise RuntimeError(
            "trio never consulted the explorer's scheduling driver: the private hook in "
            f"{_RUN_MODULE} has changed (trio {trio.__version__}); see hook_available()"
        )
    return error


def explore(
    scenario: Scenario,
    *,
    max_schedules: int = 20_000,
    stop_on_first_failure: bool = True,
    first_only: bool = False,
) -> ExplorationResult:
    """Run ``scenario`` once under each distinct task schedule, depth first.

    ``scenario`` is called afresh for every schedule and must build its own state, run its
    tasks (in a nursery), and raise (typically ``AssertionError``) if its invariant is
    violated. It must be I/O-free and deterministic apart from scheduling: no sockets,
    threads, wall-clock time or state carried over between calls. It runs under
    ``trio.testing.MockClock(autojump_threshold=0)``. A schedule in which all its tasks
    block with nothing to wake them fails with :class:`Deadlock` (detected as the virtual
    clock reaching 24 hours, so scenarios must not sleep that long); one still running
    after 10,000 batches is cancelled and fails with :class:`Livelock`.

    Exploration stops after ``max_schedules`` runs, or at the first failing schedule when
    ``stop_on_first_failure`` is true. ``exhaustive`` in the result is true only when every
    schedule was run. ``first_only`` narrows the space explored (see the module docstring).

    Raises :class:`ScheduleMismatch` if the scenario turns out not to be deterministic.
    Must be called outside ``trio.run``.
    """
    if max_schedules < 1:
        raise ValueError("max_schedules must be at least 1")
    _check_trio()
    prefix: list[int] = []
    expected: list[int] = []
    failures: list[Failure] = []
    schedules_run = 0
    while True:
        driver = _Driver(prefix, expected, first_only=first_only)
        error = _run_once(scenario, driver)
        schedules_run += 1
        if driver.mismatch is not None:
            raise ScheduleMismatch(
                f"the scenario is not deterministic: replaying the choices {tuple(prefix)}, "
                f"{driver.mismatch}"
            ) from error
        if error is not None:
            failures.append(Failure(Schedule(tuple(driver.decisions), first_only), error))
        # Backtrack to the deepest decision with an untried alternative.
        pos = len(driver.decisions) - 1
        while pos >= 0 and driver.decisions[pos] + 1 >= driver.branching[pos]:
            pos -= 1
        if pos < 0:
            return ExplorationResult(schedules_run, True, failures)
        if (error is not None and stop_on_first_failure) or schedules_run >= max_schedules:
            return ExplorationResult(schedules_run, False, failures)
        prefix = [*driver.decisions[:pos], driver.decisions[pos] + 1]
        expected = driver.branching[: pos + 1]


def replay(scenario: Scenario, schedule: Schedule) -> None:
    """Run ``scenario`` once, under exactly ``schedule``; raise whatever it raises.

    Raises :class:`ScheduleMismatch` (chained from the scenario's exception, if any) if the
    schedule's choices do not fit the scenario's decisions. Must be called outside
    ``trio.run``.
    """
    _check_trio()
    driver = _Driver(schedule.choices, None, first_only=schedule.first_only)
    error = _run_once(scenario, driver)
    mismatch = driver.mismatch
    if mismatch is None and len(driver.decisions) < len(schedule.choices):
        mismatch = (
            f"the scenario made {len(driver.decisions)} decisions, the schedule has "
            f"{len(schedule.choices)}"
        )
    if mismatch is not None:
        raise ScheduleMismatch(f"{schedule} does not fit this scenario: {mismatch}") from error
    if error is not None:
        raise error


def assert_all_schedules(
    scenario: Scenario,
    *,
    max_schedules: int = 20_000,
    first_only: bool = False,
) -> ExplorationResult:
    """:func:`explore` ``scenario`` and raise ``AssertionError`` unless every schedule was
    run and none failed.

    The error names the failing :class:`Schedule` (pass it to :func:`replay` to reproduce)
    and is chained from the scenario's exception.
    """
    result = explore(scenario, max_schedules=max_schedules, first_only=first_only)
    if result.failures:
        failure = result.failures[0]
        raise AssertionError(
            f"schedule {failure.schedule} failed (after {result.schedules_run} schedules): "
            f"{failure.exception!r}; reproduce with "
            f"trio_pd.testing.replay(scenario, {failure.schedule!r})"
        ) from failure.exception
    if not result.exhaustive:
        raise AssertionError(
            f"exploration stopped after max_schedules={max_schedules} schedules without "
            f"covering them all; shrink the scenario or raise max_schedules"
        )
    return result
