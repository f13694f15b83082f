"""trio_pd: KV-cache page transfer for prefill/decode-disaggregated LLM serving, on trio."""

import importlib.metadata as _metadata

from ._bootstrap import open_bootstrap_server as open_bootstrap_server
from ._bootstrap import serve_bootstrap as serve_bootstrap
from ._bootstrap_client import BootstrapClient as BootstrapClient
from ._decode import DecodeAgent as DecodeAgent
from ._decode import DecodeConfig as DecodeConfig
from ._decode import DecodeReceiver as DecodeReceiver
from ._decode import open_decode as open_decode
from ._errors import AdmissionClosed as AdmissionClosed
from ._errors import AuthenticationError as AuthenticationError
from ._errors import BootstrapError as BootstrapError
from ._errors import BootstrapUnreachable as BootstrapUnreachable
from ._errors import ConfigurationError as ConfigurationError
from ._errors import EngineError as EngineError
from ._errors import IncompatiblePeer as IncompatiblePeer
from ._errors import NotReady as NotReady
from ._errors import PeerLost as PeerLost
from ._errors import ProtocolError as ProtocolError
from ._errors import RegionError as RegionError
from ._errors import RemoteFailure as RemoteFailure
from ._errors import TransferAborted as TransferAborted
from ._errors import TransferError as TransferError
from ._errors import TransferTimeout as TransferTimeout
from ._errors import UnknownRank as UnknownRank
from ._errors import UnknownRoom as UnknownRoom
from ._memory import MemoryKind as MemoryKind
from ._memory import PoolSpec as PoolSpec
from ._memory import StateSpec as StateSpec
from ._memory import buffer_region as buffer_region
from ._memory import describe_pool as describe_pool
from ._prefill import PrefillAgent as PrefillAgent
from ._prefill import PrefillConfig as PrefillConfig
from ._prefill import PrefillSender as PrefillSender
from ._prefill import open_prefill as open_prefill
from ._state import KVPoll as KVPoll
from ._stats import AgentStatistics as AgentStatistics

try:  # one version source: pyproject.toml, through the installed package's metadata
    __version__: str = _metadata.version("trio-pd")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
