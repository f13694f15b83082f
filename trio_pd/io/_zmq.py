"""ZeroMQ driven from trio: the one module that touches ``zmq.FD`` and :mod:`trio.lowlevel`.

libzmq gives each socket one file descriptor (``zmq.FD``). It is *not* a readiness
descriptor in the usual sense:

* It becomes readable when the socket's command mailbox receives a command (a message
  arrived, a pipe drained, a peer attached...). It says "something may have changed", never
  *what* changed, and it serves both directions: a socket waiting to send also waits for it
  to become *readable*.
* It is edge-triggered. A libzmq call on the socket that processes commands (``send``,
  ``recv``, and reading ``zmq.EVENTS`` itself; libzmq does not promise which others) may
  drain the descriptor. If the call that drains it belongs to a different task than the one
  waiting, the waiting task is never woken: a lost wake-up.
* ``zmq.EVENTS`` (``POLLIN`` / ``POLLOUT``) is the truth. It must be read *after* the last
  libzmq call and before going to sleep on the descriptor.

:class:`Socket` keeps three rules so that any number of trio tasks may share one socket (its
waiters and their wake-ups are its :class:`_Readiness`; its libzmq calls are its own):

1. **One task sleeps on the descriptor** (trio allows only one ``wait_readable`` per fd).
   Other waiting tasks park in a per-direction :class:`trio.lowlevel.ParkingLot`. When the
   descriptor task wakes up, for whatever reason (readable, kicked, cancelled, closed), it
   unparks everyone, so that a new descriptor task is chosen and nobody sleeps unwatched.
2. **After every libzmq call, if anybody is waiting, read ``zmq.EVENTS`` and hand it out**:
   parked tasks whose direction is ready are unparked, and the descriptor task is "kicked"
   if its direction is ready. This is what makes an edge drained by one task visible to the
   others. A kick is :func:`trio.lowlevel.notify_closing` on the descriptor, which wakes its
   sleeper with :exc:`trio.ClosedResourceError` while the socket stays open: the sleeper,
   finding the socket open, takes it as a wake-up (a kick is rare: it needs two tasks on one
   socket; a private cancel scope per sleep, the other way to wake it, cost every wait on the
   descriptor about 55 Python calls, most waits of a busy agent's listeners).
3. **Never sleep without having read ``zmq.EVENTS`` since the last libzmq call**, and with no
   checkpoint between that read and going to sleep.

Closing calls :func:`trio.lowlevel.notify_closing` before the zmq socket is closed, so that a
task sleeping on the descriptor gets :exc:`trio.ClosedResourceError` rather than waiting on a
number the kernel may hand to somebody else.

Only ``POLLIN``/``POLLOUT`` readiness is handled here; message contents are the caller's
business (see ``_wire``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final, NoReturn, TypeVar, cast

import trio
import zmq

__all__ = ["Socket", "open_socket"]

_T = TypeVar("_T")

_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)

# libzmq errors that mean "this socket cannot be used any more".
_CLOSED_ERRNOS: Final = frozenset({zmq.ETERM, zmq.ENOTSOCK})


def _unusable(exc: zmq.ZMQError) -> Exception:
    """What a libzmq error is raised as: :exc:`trio.ClosedResourceError` if it says the
    socket (or its context) is gone, else the error itself."""
    if exc.errno in _CLOSED_ERRNOS:
        closed = trio.ClosedResourceError(f"zmq socket unusable: {exc}")
        closed.__cause__ = exc
        return closed
    return exc

# The per-message calls go to pyzmq's compiled socket methods, under the Python layer that
# :class:`zmq.Socket` adds (per-frame type checks, enum wrapping of flags and of ``EVENTS``):
# the same libzmq calls, about a third fewer Python calls on each message's path.
_send: Final = zmq.backend.Socket.send
_recv: Final = zmq.backend.Socket.recv
#: (typed for the one option read through it, ``EVENTS``: an int)
_get: Final = cast("Callable[[zmq.Socket[bytes], int], int]", zmq.backend.Socket.get)
_EVENTS: Final = int(zmq.EVENTS)
_DONTWAIT: Final = int(zmq.DONTWAIT)
_MORE_DONTWAIT: Final = int(zmq.SNDMORE) | _DONTWAIT


class _Readiness:
    """Every task waiting on one zmq socket, and how each is woken (the module's rules 1 to
    3): the one task sleeping on the descriptor, its direction (a kick wakes it),
    and the tasks parked meanwhile, by direction. Its :class:`Socket` hands readiness out
    through :meth:`poll` after each of its libzmq calls; ``check_open`` is the socket's (it
    raises :exc:`trio.ClosedResourceError` once the socket is closed)."""

    def __init__(
        self, zsock: zmq.Socket[bytes], fd: int, check_open: Callable[[], None]
    ) -> None:
        self._zsock = zsock
        #: the socket's descriptor (``zmq.FD``): readable when its command mailbox has news
        self.fd = fd
        self._check_open = check_open
        # Whether a task sleeps in wait_readable(fd), and its direction: other tasks wake it
        # ("kick", _kick) when zmq.EVENTS says its direction is ready.
        self._fd_waiting = False
        self._fd_flag = 0
        # Tasks waiting while another task sleeps on the fd, by direction, and how many park
        # in both (kept here: a ParkingLot's truth test is a Python call, and every libzmq
        # call of the socket asks whether anybody waits).
        self._parked_in = trio.lowlevel.ParkingLot()
        self._parked_out = trio.lowlevel.ParkingLot()
        self.parked = 0

    def has_waiters(self) -> bool:
        return self._fd_waiting or self.parked > 0

    def poll(self) -> int:
        """Read ``zmq.EVENTS`` (itself a libzmq call that may drain the fd) and wake every
        waiter whose direction it reports ready."""
        self._check_open()
        try:
            events = _get(self._zsock, _EVENTS)
        except zmq.ZMQError as exc:
            raise _unusable(exc)  # noqa: B904 (_unusable sets its cause)
        self.hand_out(events)
        return events

    def hand_out(self, events: int) -> None:
        """Wake every waiter whose direction ``events`` (just read) reports ready."""
        if events & _POLLIN:
            self._parked_in.unpark_all()
        if events & _POLLOUT:
            self._parked_out.unpark_all()
        if self._fd_waiting and events & self._fd_flag:
            self._kick()

    def _kick(self) -> None:
        """Wake the task sleeping on the descriptor (rule 2): it meets ClosedResourceError,
        finds the socket open and returns, as from a spurious wake-up. trio forgets the
        descriptor's registration; the next wait makes it anew."""
        trio.lowlevel.notify_closing(self.fd)

    def unpark_all(self) -> None:
        if self.parked:  # (after every wait on the fd: most often nobody is parked)
            self._parked_in.unpark_all()
            self._parked_out.unpark_all()

    def wake_all(self) -> None:
        self.unpark_all()
        if self._fd_waiting:
            self._kick()

    async def wait(self, flag: int) -> None:  # noqa: ASYNC910 (a kick ends a real sleep)
        """Sleep until *flag* may have become ready. May return spuriously; the caller retries.

        Cancellable; nothing is consumed or sent while waiting.
        """
        events = self.poll()
        if events & flag:
            # EVENTS says go, but the operation just said EAGAIN (it may not have processed
            # the pending commands). Retry, but yield first so that a socket whose EVENTS
            # and operations disagree can never spin the event loop.
            await trio.lowlevel.checkpoint()
            return
        if not self._fd_waiting:
            await self.sleep_fd(flag)  # become the one task on the fd
        else:
            lot = self._parked_in if flag == _POLLIN else self._parked_out
            self.parked += 1
            try:
                await lot.park()
            finally:
                self.parked -= 1

    async def sleep_fd(self, flag: int) -> None:  # noqa: ASYNC910 (a kick ends a real sleep)
        """Become the task sleeping on the descriptor for ``flag``, as :meth:`wait` does,
        without its poll: the caller read ``zmq.EVENTS`` after the socket's last libzmq call,
        with no checkpoint since, and it did not report ``flag`` (rule 3); no other task
        sleeps on the descriptor. Returns when woken (readable, kicked); cancellable."""
        self._fd_flag = flag
        self._fd_waiting = True
        try:
            await trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError:
            self._check_open()  # closed: raise; open: kicked (_kick), a wake-up
        finally:
            # Whatever woke us (readable, kicked, cancelled, closed), others may now sleep
            # unwatched: let them all re-check and elect a new fd task.
            self._fd_waiting = False
            if self.parked:
                self.unpark_all()


class Socket:
    """A zmq socket driven from trio. One per zmq socket; several trio tasks may use it.

    The wrapper takes ownership of *zsock*: closing the wrapper closes the zmq socket. If the
    socket's ``LINGER`` is still libzmq's default (``-1``, wait forever for unsent messages)
    it is set to ``0``, because an infinite linger makes :meth:`zmq.Context.term` hang on
    messages that will never leave; a linger the caller chose is kept.

    Any number of tasks may call :meth:`send_multipart` and :meth:`recv_multipart`
    concurrently on the same wrapper (and the ``*_nowait`` twins from anywhere on the trio
    thread). Each message is sent or received whole: frames of two messages never interleave.

    Every method must be called from the trio thread that runs the socket's tasks; zmq
    sockets are not thread-safe.

    Waiting is driven by ``zmq.EVENTS``, which is per socket, not per peer. Where a socket
    can say ``POLLOUT`` and still refuse a message (a ``ROUTER`` with ``ROUTER_MANDATORY``
    whose addressed peer is full), :meth:`send_multipart` polls, yielding on every round,
    instead of sleeping: use :meth:`send_multipart_nowait` there.
    """

    def __init__(self, zsock: zmq.Socket[bytes]) -> None:
        if zsock.closed:
            raise ValueError("cannot wrap a closed zmq socket")
        self._zsock = zsock
        fd = int(zsock.get(zmq.FD))
        if int(zsock.get(zmq.LINGER)) == -1:
            zsock.set(zmq.LINGER, 0)
        self._closed = False
        #: every task waiting on this socket, and how they are woken (rules 1 to 3)
        self._ready = _Readiness(zsock, fd, self._check_open)

    # ------------------------------------------------------------------ plumbing

    @property
    def zsock(self) -> zmq.Socket[bytes]:
        """The wrapped :class:`zmq.Socket`, for options (``setsockopt`` / ``getsockopt``).

        Do not send, receive, bind, connect, poll or read ``zmq.EVENTS`` through it while
        the wrapper is in use: those calls can drain the socket's edge-triggered descriptor
        behind the wrapper's back and strand a waiting task. Do not close it either; call
        :meth:`close`.
        """
        return self._zsock

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or :meth:`aclose`) was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this zmq socket was closed")

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run one libzmq call, translate its errors, and hand out readiness afterwards."""
        if self._closed:
            raise trio.ClosedResourceError("this zmq socket was closed")
        try:
            return fn(*args)
        except zmq.Again:
            raise trio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise _unusable(exc)  # noqa: B904 (_unusable sets its cause)
        finally:
            self._after_call()

    def _after_call(self) -> None:
        """The call just made may have drained the fd: if anyone is waiting on it, make sure
        they learn what it may have hidden from them (rule 2)."""
        ready = self._ready
        if self._closed or not (ready._fd_waiting or ready.parked):
            return
        try:
            self._ready.poll()
        except (trio.ClosedResourceError, zmq.ZMQError):
            # Don't let the hand-out replace the outcome of the call just made; wake every
            # waiter instead, so that each meets the error on a call of its own.
            self._ready.wake_all()

    async def _run(self, flag: int, op: Callable[[], _T]) -> _T:
        """The async twin of a ``*_nowait`` operation, the way trio's own sockets do it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            result = op()
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return result
        while True:
            # Cancelled can only come out of _wait, before op() succeeded: nothing consumed.
            await self._ready.wait(flag)
            try:
                return op()
            except trio.WouldBlock:
                continue

    # ------------------------------------------------------------------ setup

    def bind(self, addr: str) -> str:
        """Bind to *addr* and return the endpoint actually bound (``zmq.LAST_ENDPOINT``).

        With a wildcard port (``"tcp://127.0.0.1:*"``) the result names the port the kernel
        chose, e.g. ``"tcp://127.0.0.1:41237"``.

        Raises:
          trio.ClosedResourceError: if the socket was closed.
          zmq.ZMQError: if libzmq refuses (address in use, bad address...).
        """
        self._call(lambda: self._zsock.bind(addr))
        endpoint = self._zsock.get(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    def connect(self, addr: str) -> None:
        """Connect to *addr*. As with any zmq socket, the peer need not exist yet.

        Raises:
          trio.ClosedResourceError: if the socket was closed.
          zmq.ZMQError: if libzmq refuses the address.
        """
        self._call(lambda: self._zsock.connect(addr))

    # ------------------------------------------------------------------ send

    def send_multipart_nowait(self, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one multipart message without waiting; never checkpoints.

        The frames are copied, so the caller may reuse its buffers as soon as this returns.
        Queued is not delivered: zmq transmits in the background.

        Raises:
          trio.WouldBlock: if the socket cannot take the message now (its high-water mark is
            reached, or a PUSH/DEALER has no peer yet). Nothing was queued.
          trio.ClosedResourceError: if the socket was closed.
          ValueError: if *frames* is empty.
          zmq.ZMQError: for other libzmq refusals (``EHOSTUNREACH`` from a ``ROUTER`` with
            ``ROUTER_MANDATORY``, for example).
        """
        if not frames:
            raise ValueError("a zmq message needs at least one frame")
        if self._closed:
            raise trio.ClosedResourceError("this zmq socket was closed")
        # _call's work, written out: this runs for every message sent.
        zsock = self._zsock
        try:
            # Only the first frame can meet EAGAIN: once it is accepted, libzmq takes the
            # rest of the message regardless of the high-water mark. So nothing is half-sent.
            for frame in frames[:-1]:
                _send(zsock, frame, _MORE_DONTWAIT)
            _send(zsock, frames[-1], _DONTWAIT)
        except zmq.Again:
            raise trio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise _unusable(exc)  # noqa: B904 (_unusable sets its cause)
        finally:
            ready = self._ready
            if ready._fd_waiting or ready.parked:
                self._after_call()

    async def send_multipart(self, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one multipart message, waiting for room in the socket if needed.

        The frames are copied, so the caller may reuse its buffers as soon as this returns.

        **Cancellation:** cancel-atomic. If :exc:`trio.Cancelled` is raised, the message was
        not queued and never will be; if the call returns, it was queued. Always checkpoints,
        even when the socket had room.

        Raises:
          trio.ClosedResourceError: if the socket was closed before or during the call.
          ValueError: if *frames* is empty.
        """
        if not frames:
            raise ValueError("a zmq message needs at least one frame")
        await self._run(_POLLOUT, lambda: self.send_multipart_nowait(frames))

    # ------------------------------------------------------------------ receive

    def recv_multipart_nowait(self) -> list[bytes]:
        """Take one whole multipart message if one is waiting; never checkpoints.

        Raises:
          trio.WouldBlock: if no message is waiting.
          trio.ClosedResourceError: if the socket was closed.
        """
        return self._call(self._recv_frames)

    def _recv_frames(self) -> list[bytes]:
        return [frame.bytes for frame in self._recv_zmq_frames()]

    async def recv_multipart(self) -> list[bytes]:
        """Receive one whole multipart message, waiting until one arrives.

        **Cancellation:** cancel-atomic. If :exc:`trio.Cancelled` is raised, no message was
        taken from the socket: it stays there for the next receive. Always checkpoints, even
        when a message was already waiting.

        Raises:
          trio.ClosedResourceError: if the socket was closed before or during the call.
        """
        return await self._run(_POLLIN, self.recv_multipart_nowait)

    def recv_frames_nowait(self) -> list[zmq.Frame]:
        """:meth:`recv_multipart_nowait`, as :class:`zmq.Frame` objects (``copy=False``),
        which carry the connection's metadata (``frame.get("User-Id")``); never checkpoints.

        Raises:
          trio.WouldBlock: if no message is waiting.
          trio.ClosedResourceError: if the socket was closed.
        """
        return self._call(self._recv_zmq_frames)

    def _recv_zmq_frames(self) -> list[zmq.Frame]:
        # Received as zmq.Frame, whose ``more`` libzmq's receive sets: reading RCVMORE with
        # ``get`` costs two Python calls (pyzmq looks the option up in an enum) per frame.
        zsock = self._zsock
        frame: zmq.Frame = _recv(zsock, _DONTWAIT, False)
        frames = [frame]
        while frame.more:  # (the rest of a message is there once its first is)
            frame = _recv(zsock, _DONTWAIT, False)
            frames.append(frame)
        return frames

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Close the socket. Idempotent.

        Tasks waiting in :meth:`send_multipart` or :meth:`recv_multipart` get
        :exc:`trio.ClosedResourceError` at once; later calls raise it too. Messages still
        queued for sending are kept only as long as the socket's ``LINGER`` allows (``0``
        unless the caller set one: dropped).
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._ready.fd)
        self._ready.unpark_all()
        self._zsock.close()

    async def aclose(self) -> None:
        """Close the socket, then checkpoint.

        **Cancellation:** the socket is closed whether or not the call is cancelled;
        :exc:`trio.Cancelled` may be raised afterwards.
        """
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Socket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


def open_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    *,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
    ipv6: bool = False,
) -> Socket:
    """Create a zmq socket of *socket_type* in *ctx* and wrap it in a :class:`Socket`.

    *sndhwm* / *rcvhwm* set the high-water marks (messages) before the socket is bound or
    connected, which is when libzmq reads them. *ipv6* sets ``zmq.IPV6``, without which
    libzmq refuses an IPv6 address (``No such device``); it is off otherwise because a socket
    with it on that binds an IPv4 address reports it in its v4-mapped IPv6 form
    (``tcp://[::ffff:127.0.0.1]:PORT``), which is not the endpoint peers were told.
    ``LINGER`` is set to ``0`` as described in :class:`Socket`. Use the result as an async
    context manager, or close it.

    A plain (non-asyncio) socket is created whatever the context's default socket class.
    """
    zsock = cast("zmq.Socket[bytes]", ctx.socket(socket_type, socket_class=zmq.Socket))
    try:
        if ipv6:
            zsock.set(zmq.IPV6, 1)
        if sndhwm is not None:
            zsock.set(zmq.SNDHWM, sndhwm)
        if rcvhwm is not None:
            zsock.set(zmq.RCVHWM, rcvhwm)
        return Socket(zsock)
    except BaseException:
        zsock.close(linger=0)
        raise


async def serve(
    sock: Socket, handle: Callable[[list[Any]], object], batch: int, *, frames: bool = False
) -> NoReturn:
    """Hand every message ``sock`` receives to ``handle``, in order, until cancelled or
    closed: :meth:`Socket.recv_multipart` in a loop, without its per-message costs. Each message
    is a list of ``bytes``; with ``frames=True``, of :class:`zmq.Frame` objects, which
    carry the connection's metadata (see :meth:`Socket.recv_frames_nowait`).

    ``handle`` is synchronous and runs between two receives. What is already waiting is
    taken in the same scheduling step, at most ``batch`` messages; then the loop yields
    (a checkpoint) before it takes more, so a long burst still lets other tasks run. A
    message behind a burst (an ABORT behind TRANSFERs) thus waits for no scheduling round
    per message ahead of it. Between two messages the loop asks ``zmq.EVENTS`` whether
    another is waiting (a read that keeps the GIL, where a receive that finds nothing
    releases it and raises); when none is, that same read is the one rule 3 asks for
    before sleeping on the descriptor, so a wake-up costs one ``EVENTS`` read, one
    receive and one wait. (One coroutine, with no layers above or below it but the
    sleep: every frame of the chain is resumed on every wake-up.)

    **Cancellation:** at a checkpoint only, between two messages: each message is either
    handed to ``handle`` or left on the socket.

    Raises:
      trio.ClosedResourceError: once the socket is closed.
      ValueError: if ``batch`` is below 1.
    """
    copy = not frames
    if batch < 1:
        raise ValueError(f"batch must be at least 1, not {batch!r}")
    zsock, ready = sock._zsock, sock._ready
    await trio.lowlevel.checkpoint_if_cancelled()
    while True:
        # One scheduling step: take what is waiting, ``batch`` messages at most. (Within it
        # only the handler can close the socket, and it is asked after each one.)
        if sock._closed:
            raise trio.ClosedResourceError("this zmq socket was closed")
        taken = 0
        events = -1  # -1: zmq.EVENTS not read since the last libzmq call
        while True:
            try:
                frame: zmq.Frame = _recv(zsock, _DONTWAIT, False)
                message = [frame.bytes if copy else frame]
                while frame.more:  # (the rest of a message is there once its first is)
                    frame = _recv(zsock, _DONTWAIT, False)
                    message.append(frame.bytes if copy else frame)
            except zmq.Again:
                events = -1
                break
            except zmq.ZMQError as exc:
                raise _unusable(exc)  # noqa: B904 (_unusable sets its cause)
            finally:
                if ready._fd_waiting or ready.parked:
                    sock._after_call()
            handle(message)
            if sock._closed:  # (by the handler: never read, or sleep on, a closed socket)
                raise trio.ClosedResourceError("this zmq socket was closed")
            taken += 1
            if taken == batch:
                break
            try:
                events = _get(zsock, _EVENTS)
            except zmq.ZMQError as exc:
                raise _unusable(exc)  # noqa: B904 (_unusable sets its cause)
            if ready._fd_waiting or ready.parked:
                ready.hand_out(events)
            if not events & _POLLIN:
                break
        if taken == batch:
            await trio.lowlevel.checkpoint()
            continue
        # A receive met EAGAIN (events < 0): read EVENTS (rule 3). Should it say a
        # message is there after all, yield before trying again, so that a socket whose
        # EVENTS and receives disagree can never spin the event loop.
        if events < 0 and ready.poll() & _POLLIN:
            await trio.lowlevel.checkpoint()
            continue
        if ready._fd_waiting:
            await ready.wait(_POLLIN)  # another task sleeps on the fd: park (rule 1)
        else:
            await ready.sleep_fd(_POLLIN)
