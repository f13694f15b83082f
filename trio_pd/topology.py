"""Which rank writes which heads where, for any pair of prefill and decode TP sizes: the
functions docs/topologies.md uses to explain a topology, public.

``head_range(rank, tp_size, total_heads)`` is the half-open range of global KV heads a rank
holds; ``source_ranks(decode_rank, prefill_tp, decode_tp)`` the prefill ranks that write to a
decode rank; ``served_decode_ranks(prefill_rank, prefill_tp, decode_tp)`` the reverse;
``write_heads(prefill_rank, decode_rank, prefill_tp, decode_tp, total_heads, layout)`` the heads
one prefill rank writes to one decode rank (None: none, a dummy pairing); ``aux_writer(
decode_rank, prefill_tp, decode_tp)`` the one prefill rank that writes a decode rank's aux row;
``writes_aux(prefill_rank, decode_rank, prefill_tp, decode_tp, pp_rank, pp_size)`` whether a
rank of a PP stage writes it (the last stage's aux writer only).
Each raises ``ValueError`` for TP sizes that cannot pair.
"""

from .core._topology import aux_writer as aux_writer
from .core._topology import head_range as head_range
from .core._topology import served_decode_ranks as served_decode_ranks
from .core._topology import source_ranks as source_ranks
from .core._topology import write_heads as write_heads
from .core._topology import writes_aux as writes_aux

__all__ = [
    "aux_writer", "head_range", "served_decode_ranks", "source_ranks", "write_heads",
    "writes_aux",
]
