"""The bootstrap service's DP-attention records: which DP rank holds each room, bounded and
expiring, and the bodies of the two requests that write and read them. Pure: no I/O (the
caller passes the time).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Final

import msgspec

from ._bootstrap_records import UNKNOWN_DP_RANK, DpRoom

#: Default ``dp_room_ttl``: seconds a "room R is on DP rank K" record is kept (twice the
#: agents' default bootstrap timeout, after which neither side waits for the room).
DP_ROOM_TTL: Final = 60.0
#: Default ``max_dp_rooms``: records held at once (about 25 MB at most).
MAX_DP_ROOMS: Final = 100_000


class DpRooms:
    """Which DP rank holds each room (DP attention): one record per room id, bounded and
    expiring. Pure: the caller passes the time (``trio.current_time()``).

    At most ``max_entries`` records: a new one past that replaces the oldest (counted
    :attr:`evicted`). A record lives ``ttl`` seconds from its last registration (counted
    :attr:`expired` when it goes; expired records go at the next registration or query).
    A record made with an epoch answers only for that use of the room id (or a query that
    names none); one made without answers for any.
    """

    def __init__(self, *, max_entries: int, ttl: float) -> None:
        self._max, self._ttl = max_entries, ttl
        # room -> (dp_rank, epoch or None, expires); oldest (soonest to expire) first
        self._entries: OrderedDict[int, tuple[int, int | None, float]] = OrderedDict()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            room, (_, _, expires) = next(iter(entries.items()))
            if expires > now:
                return
            del entries[room]
            self.expired += 1

    def put(self, room: int, epoch: int | None, dp_rank: int, now: float) -> None:
        self.expire(now)
        entries = self._entries
        if room in entries:
            entries.move_to_end(room)  # its expiry moves too: the order stays by expiry
        elif len(entries) >= self._max:
            entries.popitem(last=False)
            self.evicted += 1
        entries[room] = (dp_rank, epoch, now + self._ttl)

    def get(self, room: int, epoch: int | None, now: float) -> int:
        self.expire(now)
        entry = self._entries.get(room)
        if entry is None:
            return UNKNOWN_DP_RANK
        dp_rank, held, _ = entry
        if held is not None and epoch is not None and held != epoch:
            return UNKNOWN_DP_RANK  # a record of another use of the room id
        return dp_rank


class DpRegistration(msgspec.Struct, frozen=True):
    """The body of ``POST /register_dp_rank``."""

    dp_rank: Annotated[int, msgspec.Meta(ge=0)]
    rooms: list[DpRoom]


class DpQuery(msgspec.Struct, frozen=True):
    """The body of ``POST /query_dp_ranks``."""

    rooms: list[DpRoom]

