"""The KV dtype in pairing: two pools with the same bytes per head but another dtype (bf16
and fp16) pass every shape check and would move garbage reported as Success. A pool that
names its dtype pairs only with one that names the same, or says nothing ("unknown")."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import trio

from trio_pd import (
    ConfigurationError,
    IncompatiblePeer,
    KVPoll,
    ProtocolError,
    describe_pool,
    open_bootstrap_server,
    open_decode,
    open_prefill,
)
from trio_pd.core import _wire
from trio_pd.core._memory import kv_dtype_name
from trio_pd.core._topology import pairing_problem
from trio_pd.engines import make_engine
from trio_pd.testing.pools import HostKVPool


def pool(kv_dtype: str = "unknown") -> HostKVPool:
    return HostKVPool(layout="mha", num_pages=16, num_layers=2, page_size=4, head_bytes=16,
                      heads=2, aux_slots=8, kv_dtype=kv_dtype)


@pytest.mark.parametrize(
    ("given", "name"),
    [
        (None, "unknown"), ("unknown", "unknown"), ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"),
        ("half", "float16"), (np.float16, "float16"), (np.dtype("float32"), "float32"),
        ("fp8_e4m3", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
    ],
)
def test_dtype_names_are_normalised(given: object, name: str) -> None:
    assert kv_dtype_name(given) == name


@pytest.mark.parametrize("bad", ["", "bf 16", "16bit", 3, "x" * 40])
def test_a_name_that_is_no_dtype_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="kv_dtype"):
        kv_dtype_name(bad)
    with pytest.raises(ConfigurationError, match="kv_dtype"):
        pool(bad)


def _problem(ours: str, theirs: str) -> str | None:
    return pairing_problem(
        layout="mha", page_size=4, head_bytes=16, num_layers=2, aux_item_len=64, kv_heads=2,
        prefill_tp=1, peer_layout="mha", peer_page_size=4, peer_head_bytes=16,
        peer_num_layers=2, peer_aux_item_len=64, peer_rank=0, peer_tp=1, peer_heads=2,
        peer_first_head=0, kv_dtype=ours, peer_kv_dtype=theirs,
    )


def test_pairing_compares_dtypes_both_sides_name() -> None:
    assert _problem("bfloat16", "float16") == "KV dtype: prefill bfloat16, decode float16"
    assert _problem("bfloat16", "bfloat16") is None
    assert _problem("bfloat16", "unknown") is None  # one side does not say: not checked
    assert _problem("unknown", "float8_e4m3fn") is None


def test_describe_pool_takes_the_dtype_of_the_buffers() -> None:
    def described(dtype: object, **kw: object) -> str:
        page = 4 * 2 * 16  # page_size * heads * head_bytes
        kv = [np.zeros(8 * page // np.dtype(dtype).itemsize, dtype=dtype) for _ in range(4)]
        aux = np.zeros(8 * 64, dtype=np.uint8)
        spec = describe_pool(layout="mha", page_size=4, num_layers=2, head_bytes=16, heads=2,
                             buffers=kv, aux=aux, aux_item_len=64, **kw)
        return spec.kv_dtype

    assert described(np.float16) == "float16"
    assert described(np.float32) == "float32"
    assert described(np.uint8) == "unknown"  # bytes say nothing (fp8 is stored as bytes too)
    assert described(np.uint8, kv_dtype="fp8_e4m3") == "float8_e4m3fn"
    assert described(np.float16, kv_dtype="bfloat16") == "bfloat16"  # given wins


def _register(spec_pool: HostKVPool, **kw: bool) -> _wire.Register:
    return _wire.Register(
        v=_wire.WIRE_VERSION, endpoint="tcp://127.0.0.1:5", decode_rank=0, decode_tp=1,
        engine="mooncake", session="127.0.0.1:6", engine_meta=b"",
        pool=_wire.PoolWire.from_spec(spec_pool.spec, **kw),
    )


def test_the_wire_carries_a_known_dtype_and_nothing_for_an_unknown_one() -> None:
    """No wire version bump: a pool that does not name a dtype (an older peer's, always)
    travels without the field, and reads as "unknown"; one that names it carries it, unless
    the peer may predate the field (``with_dtype=False``)."""
    plain, named = pool(), pool("bf16")
    [header] = _wire.encode(_register(plain))
    assert b"kv_dtype" not in header
    msg = _wire.decode([header])[0]
    assert isinstance(msg, _wire.Register) and msg.pool.to_spec().kv_dtype == "unknown"
    [header] = _wire.encode(_register(named))
    assert b"kv_dtype" in header
    msg = _wire.decode([header])[0]
    assert isinstance(msg, _wire.Register) and msg.pool.to_spec() == named.spec
    [header] = _wire.encode(_register(named, with_dtype=False))
    assert b"kv_dtype" not in header
    raw = msgspec.msgpack.decode(header)
    raw["pool"]["kv_dtype"] = "BF 16"  # a peer's name is checked as ours are
    with pytest.raises(ProtocolError, match="kv_dtype"):
        _wire.decode([msgspec.msgpack.encode(raw)])


async def _one_room(src: HostKVPool, dst: HostKVPool, engine_name: str) -> tuple[object, ...]:
    """One request from ``src`` to ``dst``: (decode status, its failure, prefill's refusals,
    the decode pool's dtype as prefill registered it, or None)."""
    src.fill(np.arange(2), room=4)
    with make_engine(engine_name) as pe, make_engine(engine_name) as de:
        async with (
            open_bootstrap_server() as boot,
            open_prefill(engine=pe, pool=src.spec, bootstrap_url=boot.url,
                         kv_heads=2) as prefill,
            open_decode(engine=de, pool=dst.spec) as decode,
        ):
            sender = prefill.sender(4, num_pages=2, aux_slot=0)
            receiver = decode.receiver(4, bootstrap_url=boot.url)
            receiver.init(np.arange(6, 8), aux_slot=1)
            sender.send(np.arange(2), last=True)
            with trio.fail_after(15):
                status = await receiver.wait()
                while not (prefill.peers.all() or prefill.peers.refused):  # noqa: ASYNC110
                    await trio.sleep(0.01)  # (the REGISTER goes out even when refused)
            peers = prefill.peers.all()
            return (status, receiver.failure, dict(prefill.peers.refused),
                    peers[0].pool.kv_dtype if peers else None)


async def test_a_dtype_mismatch_is_refused_on_both_sides(engine_name: str) -> None:
    src, dst = pool("bfloat16"), pool("float16")
    status, failure, refused, _ = await _one_room(src, dst, engine_name)
    assert status is KVPoll.Failed
    assert isinstance(failure, IncompatiblePeer), failure
    assert "KV dtype: prefill bfloat16, decode float16" in str(failure)
    assert len(refused) == 1 and "KV dtype: prefill bfloat16, decode float16" in next(
        iter(refused.values())
    ), refused
    assert not (dst.kv[:, 6:8] != 0).any()  # nothing was written


@pytest.mark.parametrize(
    ("ours", "theirs", "registered"),
    [("bfloat16", "bfloat16", "bfloat16"), ("bfloat16", "unknown", "unknown"),
     ("unknown", "float16", "unknown")],
    ids=["same", "decode-says-nothing", "prefill-says-nothing"],
)
async def test_same_or_unstated_dtypes_pair(
    engine_name: str, ours: str, theirs: str, registered: str
) -> None:
    """A prefill rank that publishes no dtype (as one that predates the field) is sent a
    REGISTER without one: it would refuse a pool field it does not know."""
    src, dst = pool(ours), pool(theirs)
    status, failure, refused, seen = await _one_room(src, dst, engine_name)
    assert status is KVPoll.Success, failure
    assert not refused and seen == registered
    assert (dst.kv[:, 6:8] == src.kv[:, 0:2]).all()
