"""The call list: every call SGLang 0.5.23's scheduler code makes on the connector objects,
read from SGLang's source, against the adapter's table (tests/sglang/calls.py). Only the
plugin test imports SGLang (the ``sglang_runtime`` fixture); the rest reads its source."""

from __future__ import annotations

import types

import pytest

from trio_pd import ConfigurationError
from trio_pd.compat import sglang as adapter

from . import callforms
from .callforms import call_forms
from .calls import CALLS, REFUSED, SERVED


def test_every_call_sglang_makes_is_served_or_refused() -> None:
    found = call_forms()
    new = sorted(set(found) - set(CALLS))
    gone = sorted(set(CALLS) - set(found))
    assert not new and not gone, (
        "SGLang's calls on the connector changed:\n  new: " + "\n  new: ".join(new)
        + "\n  gone: " + "\n  gone: ".join(gone)
    )


_CLASS = {"manager": adapter.KVManager, "sender": adapter.KVSender,
          "receiver": adapter.KVReceiver, "bootstrap_server": adapter.KVBootstrapServer}
#: served names that are instance attributes (set in __init__), or looked up with a default
_INSTANCE = {"kv_args", "prefill_info_table", "enable_deferred_decode_kv_release",
             "abort_notified", "bootstrap_infos", "kv_mgr"}


@pytest.mark.parametrize("form", sorted(f for f, (st, _) in CALLS.items() if st == SERVED))
def test_each_served_call_exists_on_the_adapter(form: str) -> None:
    role, rest = form.split(": ", 1)
    name = rest.split("(")[0].split(" ")[0]
    if name == "<class>" or "[getattr]" in rest or "[hasattr]" in rest:
        return  # (constructions run in test_queues; guarded look-ups may find nothing)
    for r in role.split("/"):
        assert name in _INSTANCE or hasattr(_CLASS[r], name), (r, name)


_FLAGS = {
    "--disaggregation-decode-allocation-policy prefill_complete":
        ({"disaggregation_decode_allocation_policy": "prefill_complete"}, {}),
    "--disaggregation-enable-kv-checksum": ({"disaggregation_enable_kv_checksum": True}, {}),
    "SGLANG_DISAGG_STAGING_BUFFER": ({}, {"SGLANG_DISAGG_STAGING_BUFFER": "1"}),
    "--enable-memory-saver": ({"enable_memory_saver": True}, {}),
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX":
        ({}, {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "true"}),
    "--disaggregation-decode-host-receive-threshold":
        ({"disaggregation_decode_host_receive_threshold": 0.5}, {}),
    "--enable-hisparse": ({"enable_hisparse": True}, {}),
}


@pytest.mark.parametrize("form", sorted(f for f, (st, _) in CALLS.items() if st == REFUSED))
def test_each_refused_call_is_refused_when_the_manager_is_built(form: str) -> None:
    """The flag that brings the call fails check_server_args (what KVManager runs first),
    naming the flag; and the flag is one SGLang 0.5.23 has."""
    note = CALLS[form][1]
    flag = next(f for f in _FLAGS if note.startswith(f.split(" ")[0]))
    args, env = _FLAGS[flag]
    assert not set(args) - callforms.server_arg_fields(), args
    assert not set(env) - callforms.environment_variables(), env
    inf = {adapter.DEFERRED_RELEASE_TIMEOUT_ENV: "inf"}
    base = types.SimpleNamespace()
    for mode in ("prefill", "decode"):
        adapter.check_server_args(base, mode, inf)  # (the flag off: accepted)
    refused = 0
    for mode in ("prefill", "decode"):
        try:
            adapter.check_server_args(types.SimpleNamespace(**args), mode, {**inf, **env})
        except ConfigurationError as exc:
            assert flag.split(" ")[0] in str(exc), exc
            refused += 1
    assert refused, flag


def test_sglang_deferred_release_deadline_must_be_inf() -> None:
    base = types.SimpleNamespace()
    for env in ({}, {adapter.DEFERRED_RELEASE_TIMEOUT_ENV: "600"}):
        with pytest.raises(ConfigurationError, match=adapter.DEFERRED_RELEASE_TIMEOUT_ENV):
            adapter.check_server_args(base, "decode", env)
    adapter.check_server_args(base, "decode", {adapter.DEFERRED_RELEASE_TIMEOUT_ENV: "inf"})
    adapter.check_server_args(base, "decode", {adapter.DEFERRED_RELEASE_ENV: "0"})
    adapter.check_server_args(base, "prefill", {})


def test_the_plugin_makes_sglangs_class_mapping_answer_trio_pd(
    monkeypatch: pytest.MonkeyPatch, sglang_runtime: None,
) -> None:
    """With TRIO_PD_SGLANG=1, the plugin SGLang loads (entry point ``trio_pd``) hooks
    ``get_kv_class`` through SGLang's own HookRegistry, in every module that imported it;
    KVArgs and the backends trio_pd does not run over stay SGLang's. Without the variable
    it changes nothing."""
    from importlib.metadata import entry_points

    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins.hook_registry import HookRegistry

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "trio_pd"]
    assert ep.load() is adapter.sglang_plugin
    for mod in (utils, prefill, decode, disagg_service):  # (restored after the test)
        monkeypatch.setattr(mod, "get_kv_class", mod.get_kv_class)
    monkeypatch.setattr(utils, "setup_state_kv_args", utils.setup_state_kv_args)
    for mod in (prefill, decode):
        monkeypatch.setattr(mod, "setup_state_kv_args", mod.setup_state_kv_args)
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.delenv(adapter.PLUGIN_ENV, raising=False)
    adapter.sglang_plugin()
    assert not HookRegistry._hooks
    monkeypatch.setenv(adapter.PLUGIN_ENV, "1")
    monkeypatch.delenv(adapter.DEFERRED_RELEASE_TIMEOUT_ENV, raising=False)
    adapter.sglang_plugin()
    HookRegistry.apply_hooks()
    import os

    assert os.environ[adapter.DEFERRED_RELEASE_TIMEOUT_ENV] == "inf"
    monkeypatch.delenv(adapter.DEFERRED_RELEASE_TIMEOUT_ENV)
    for mod in (utils, prefill, decode, disagg_service):
        get = mod.get_kv_class
        assert get(TransferBackend.MOONCAKE, KVClassType.MANAGER) is adapter.KVManager
        assert get(TransferBackend.NIXL, KVClassType.RECEIVER) is adapter.KVReceiver
        assert get(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER) is (
            adapter.KVBootstrapServer)
        assert get(TransferBackend.MOONCAKE, KVClassType.KVARGS) is not adapter.KVArgs
        assert get(TransferBackend.FAKE, KVClassType.SENDER) is not adapter.KVSender
