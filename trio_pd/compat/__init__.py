"""Adapters that give trio_pd the shape of another serving engine's PD connector API.

* :mod:`trio_pd.compat.sglang`: SGLang's ``KVManager`` / ``KVSender`` / ``KVReceiver`` /
  ``KVBootstrapServer`` / ``KVPoll`` / ``KVArgs``, over :mod:`trio_pd.sync` (docs/sglang.md).

Importing this package loads nothing: each adapter is imported on its own, and none imports
the engine it imitates.
"""
