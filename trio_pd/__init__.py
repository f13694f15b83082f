"""trio_pd: KV-cache page transfer for prefill/decode-disaggregated LLM serving, on trio."""

import importlib.metadata as _metadata

from .agents._decode import DecodeAgent as DecodeAgent
from .agents._decode import DecodeConfig as DecodeConfig
from .agents._decode import DecodeReceiver as DecodeReceiver
from .agents._decode import open_decode as open_decode
from .agents._prefill import PrefillAgent as PrefillAgent
from .agents._prefill import PrefillConfig as PrefillConfig
from .agents._prefill import PrefillSender as PrefillSender
from .agents._prefill import open_prefill as open_prefill
from .bootstrap._bootstrap import open_bootstrap_server as open_bootstrap_server
from .bootstrap._bootstrap import serve_bootstrap as serve_bootstrap
from .bootstrap._bootstrap_client import BootstrapClient as BootstrapClient
from .core._errors import AdmissionClosed as AdmissionClosed
from .core._errors import AuthenticationError as AuthenticationError
from .core._errors import BootstrapError as BootstrapError
from .core._errors import BootstrapUnreachable as BootstrapUnreachable
from .core._errors import ConfigurationError as ConfigurationError
from .core._errors import EngineError as EngineError
from .core._errors import IncompatiblePeer as IncompatiblePeer
from .core._errors import NotReady as NotReady
from .core._errors import PeerLost as PeerLost
from .core._errors import ProtocolError as ProtocolError
from .core._errors import RegionError as RegionError
from .core._errors import RemoteFailure as RemoteFailure
from .core._errors import TransferAborted as TransferAborted
from .core._errors import TransferError as TransferError
from .core._errors import TransferTimeout as TransferTimeout
from .core._errors import UnknownRank as UnknownRank
from .core._errors import UnknownRoom as UnknownRoom
from .core._memory import MemoryKind as MemoryKind
from .core._memory import PoolSpec as PoolSpec
from .core._memory import StateSpec as StateSpec
from .core._memory import buffer_region as buffer_region
from .core._memory import describe_pool as describe_pool
from .core._state import KVPoll as KVPoll
from .core._stats import AgentStatistics as AgentStatistics

try:  # one version source: pyproject.toml, through the installed package's metadata
    __version__: str = _metadata.version("trio-pd")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
