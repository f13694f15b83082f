"""Transfer engines behind one small protocol."""

from typing import Any

from ..core._errors import ConfigurationError
from ..core._errors import EngineError as EngineError
from ._base import Addrs as Addrs
from ._base import ClosingEngine as ClosingEngine
from ._base import Deferred as Deferred
from ._base import Fence as Fence
from ._base import FenceOutcome as FenceOutcome
from ._base import Lens as Lens
from ._base import Pending as Pending
from ._base import Region as Region
from ._base import TransferEngine as TransferEngine
from ._base import call_mark as call_mark
from ._base import fence_writer as fence_writer
from ._base import flushed as flushed
from ._base import join_bytes as join_bytes
from ._base import keeps_failed_calls as keeps_failed_calls
from ._base import start_write as start_write

ENGINE_NAMES = ("mooncake", "nixl")


def make_engine(name: str, host: str = "127.0.0.1", **kw: Any) -> ClosingEngine:
    """Build the engine called ``name``: "mooncake" or "nixl". The caller owns it: close it
    once no agent uses it, or build it in a ``with`` block, whose exit closes it.

    The adapters are imported here, so this package imports without either wheel. ``host`` is
    the address Mooncake peers reach this engine on (NIXL's UCX finds its own interfaces and
    ignores it). Other keywords go to the adapter's constructor. Raises
    :class:`~trio_pd.ConfigurationError` for an unknown name, and, saying what to install,
    when the engine's module is missing (:func:`require_engine`).
    """
    if name == "mooncake":
        from .mooncake import MooncakeEngine

        return MooncakeEngine(host, **kw)
    if name == "nixl":
        from .nixl import NixlEngine

        return NixlEngine(**kw)
    raise _unknown(name)


def require_engine(name: str) -> None:
    """Check, before anything starts, that :func:`make_engine` can build engine ``name``
    here: its Python module is installed and loads. Raises
    :class:`~trio_pd.ConfigurationError` with what to install otherwise (the command line
    refuses ``--engine`` with it). Builds no engine."""
    if name == "mooncake":
        from .mooncake import import_engine_class

        import_engine_class()
    elif name == "nixl":
        from .nixl import import_api

        import_api()
    else:
        raise _unknown(name)


def _unknown(name: str) -> ConfigurationError:
    return ConfigurationError(f"unknown engine {name!r}; one of {', '.join(ENGINE_NAMES)}")
