"""Private to trio_pd: the pure core: every decision about a room, the status rules, lease and ack
books, transfer planning, memory regions, message encoding, errors and counters. No I/O: no
trio, no sockets, no engine, no clock (tests/test_purity.py checks every module here). Nothing
here is public API: import from ``trio_pd`` and its public modules.
"""
