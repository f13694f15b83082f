"""What the adapter and its plugin name in SGLang, beside the connector calls: the server
arguments and environment variables it reads or refuses, the functions its plugin hooks,
the plugin group, and the values it shares (KVPoll, the backend and class-type names),
each checked against SGLang 0.5.23's source, read with ``ast`` (no SGLang import: this runs
where only SGLang's wheel is unpacked, ``nox -s sglang_calls``)."""

from __future__ import annotations

from trio_pd.compat import sglang as adapter

from . import callforms


def test_every_sglang_variable_the_adapter_reads_exists() -> None:
    declared = callforms.environment_variables()
    read = {*adapter.ENV_KNOBS, adapter.DEFERRED_RELEASE_ENV,
            adapter.DEFERRED_RELEASE_TIMEOUT_ENV}
    refused = {flag for _, flag, _, _ in adapter._REFUSED_FLAGS if not flag.startswith("--")}
    assert refused, "no refused variable found: the table's shape changed"
    assert not (read | refused) - declared, sorted((read | refused) - declared)


def test_every_server_argument_the_adapter_refuses_exists() -> None:
    fields = callforms.server_arg_fields()
    assert {"disaggregation_transfer_backend", "disaggregation_bootstrap_port"} <= fields
    flags = [flag for _, flag, _, _ in adapter._REFUSED_FLAGS if flag.startswith("--")]
    assert flags
    for flag in flags:
        assert flag[2:].replace("-", "_") in fields, flag


def test_the_plugins_hook_targets_and_group_exist() -> None:
    """sglang_plugin hooks these by name (a moved function would leave the plugin doing
    nothing), under the entry-point group SGLang loads."""
    utils = callforms.module_functions("sglang/srt/disaggregation/utils.py")
    assert {"get_kv_class", "setup_state_kv_args"} <= utils
    plugins = callforms.module_constants("sglang/srt/plugins/__init__.py")
    assert plugins["GENERAL_PLUGINS_GROUP"] == "sglang.srt.plugins"
    hooks = callforms.class_constants("sglang/srt/plugins/hook_registry.py", "HookType")
    assert hooks["AROUND"] == "around"


def test_shared_values_agree() -> None:
    """KVPoll's values (SGLang's ints, trio_pd's IntEnum), and the backend and class-type
    names get_kv_class answers by."""
    kvpoll = callforms.class_constants("sglang/srt/disaggregation/base/conn.py", "KVPoll")
    assert kvpoll == {p.name: int(p) for p in adapter.KVPoll}
    utils = "sglang/srt/disaggregation/utils.py"
    backends = set(callforms.class_constants(utils, "TransferBackend").values())
    assert {"mooncake", "nixl"} <= backends
    kinds = set(callforms.class_constants(utils, "KVClassType").values())
    assert set(adapter._CLASSES) <= kinds
