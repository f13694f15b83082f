"""The adapter's answer to every call form SGLang 0.5.23's scheduler code makes on the
connector objects (:func:`tests.sglang.callforms.call_forms`): served, refused when the
manager is built (naming the flag that brings the call), or not reached from the
scheduler's code (guarded by a capability the adapter does not claim). A form that is not
in this table fails the conformance test: it is what a new SGLang version added.
"""

from __future__ import annotations

#: served: the adapter has the attribute and SGLang's code path runs over it
SERVED = "served"
#: refused: check_server_args raises ConfigurationError naming this flag at construction
REFUSED = "refused"
#: unreachable: SGLang only calls it after a capability check the adapter answers "no"
UNREACHED = "unreached"

CALLS: dict[str, tuple[str, str]] = {
    "bootstrap_server: <class>(0, host=, port=)": (SERVED, "KVBootstrapServer(host=, port=)"),
    "manager: <class>(4)": (SERVED, "KVManager(args, mode, server_args, is_mla_backend)"),
    "manager: <class>(4, **)": (SERVED, "prefill passes no extra keywords but on ascend"),
    "manager: _ensure_prefill_recompute_executor(0)": (
        UNREACHED, "only for prefill DP-rank queries; prefill_info_table says dp_size 1"),
    "manager: _prefetch_staging_reqs [getattr]": (SERVED, "absent: SGLang skips the prefetch"),
    "manager: _staging_handler [write]": (REFUSED, "SGLANG_DISAGG_STAGING_BUFFER"),
    "manager: attn_cp_rank [read]": (UNREACHED, "a helper of SGLang's own backends"),
    "manager: attn_cp_size [read]": (UNREACHED, "a helper of SGLang's own backends"),
    "manager: clear_deferred_abort_state(1)": (SERVED, "forgets a drained room"),
    "manager: deregister_buffer_to_engine [hasattr]": (
        REFUSED, "--enable-memory-saver (absent: nothing deregistered)"),
    "manager: deregister_buffer_to_engine(0)": (REFUSED, "--enable-memory-saver"),
    "manager: enable_all_cp_ranks_for_transfer [read]": (
        UNREACHED, "read only for senders with supports_host_tensor_indices"),
    "manager: enable_deferred_decode_kv_release [read]": (SERVED, "from SGLang's variable"),
    "manager: is_abort_release_safe(2)": (SERVED, "True once trio_pd drained the room"),
    "manager: is_dummy_cp_rank [getattr]": (SERVED, "absent: False"),
    "manager: kv_args [read]": (SERVED, "the KVArgs it was built from"),
    "manager: prefill_info_table [read]": (SERVED, "a PrefillInfo per address"),
    "manager: register_buffer_to_engine [hasattr]": (REFUSED, "--enable-memory-saver"),
    "manager: register_buffer_to_engine(0)": (REFUSED, "--enable-memory-saver"),
    "manager: set_kv_buffer_tensors [hasattr]": (REFUSED, "SGLANG_DISAGG_STAGING_BUFFER"),
    "manager: set_kv_buffer_tensors(3, slot_layer_ids=)": (
        REFUSED, "SGLANG_DISAGG_STAGING_BUFFER"),
    "manager: should_verify_kv_checksum(1)": (REFUSED, "--disaggregation-enable-kv-checksum"),
    "manager: submit_prefill_recompute(2)": (SERVED, "the request fails cleanly"),
    "manager: supports_host_destination [read]": (SERVED, "False"),
    "manager: transfer_infos [read]": (UNREACHED, "read only when _prefetch_staging_reqs exists"),
    "manager: try_ensure_parallel_info(1)": (SERVED, "True: receivers resolve themselves"),
    "receiver: <class>(0, bootstrap_addr=, bootstrap_room=, mgr=)": (SERVED, "KVReceiver"),
    "receiver: abort(0)": (SERVED, "Failed at once; pages held for the drain"),
    "receiver: abort_notified [read]": (SERVED, "pages given and the room failed"),
    "receiver: bootstrap_infos [read]": (SERVED, "one entry: trio_pd's drain covers all ranks"),
    "receiver: clear(0)": (SERVED, "aborts a room never given pages"),
    "receiver: conclude_state [read]": (
        REFUSED, "--disaggregation-decode-allocation-policy prefill_complete"),
    "receiver: ensure_abort_notified(0, force_arm=)": (SERVED, "aborts, arms the hold"),
    "receiver: failure_exception(0)": (SERVED, "raises the room's TransferError"),
    "receiver: init(1)": (SERVED, "any prefill DP rank: the receiver routes itself"),
    "receiver: is_abort_release_safe(0)": (
        REFUSED, "--disaggregation-decode-host-receive-threshold"),
    "receiver: require_staging [hasattr]": (SERVED, "False"),
    "receiver: require_staging [read]": (SERVED, "False"),
    "receiver: send_metadata(3, **)": (
        SERVED, "decode_prefix_len=, destination=DEVICE; device_kv_indices= is "
        "--enable-hisparse, refused"),
    "receiver: supports_host_destination [read]": (SERVED, "False"),
    "sender/receiver: poll(0)": (SERVED, "SGLang's KVPoll semantics"),
    "sender/receiver: poll_pp_consensus(0)": (SERVED, "prefill PP: the same as poll()"),
    "sender: <class>(0, bootstrap_addr=, bootstrap_room=, mgr=, "
    "req_has_disagg_prefill_dp_rank=)": (SERVED, "KVSender"),
    "sender: _early_send_wait_event [write]": (
        REFUSED, "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"),
    "sender: abort [hasattr]": (SERVED, "present"),
    "sender: abort(0)": (SERVED, "before init too: decode fails at once"),
    "sender: clear(0)": (SERVED, "nothing to do"),
    "sender: failure_exception(0)": (SERVED, "raises the room's TransferError"),
    "sender: get_max_transfer_tokens(0)": (SERVED, "None: trio_pd chunks itself"),
    "sender: get_transfer_metric(0)": (SERVED, "KVTransferMetric per room"),
    "sender: init(2)": (SERVED, "num pages, metadata slot"),
    "sender: kv_mgr [getattr]": (SERVED, "the manager"),
    "sender: mark_prefill_complete(0)": (
        REFUSED, "--disaggregation-decode-allocation-policy prefill_complete"),
    "sender: pop_decode_prefix_len(0)": (SERVED, "0: the prefill rank skips decode's prefix"),
    "sender: send(2, indices_event=, num_kv_tokens=)": (
        UNREACHED, "only for senders with supports_host_tensor_indices"),
    "sender: send(2, num_kv_tokens=)": (SERVED, "page ids, state slots with the last"),
    "sender: should_send_kv_chunk(2)": (SERVED, "pages, or the last chunk"),
    "sender: supports_host_tensor_indices [getattr]": (SERVED, "absent: False"),
}
