"""Private to trio_pd: the trio layer: the prefill and decode agents, their chunk runner, peer
registry, prefill sources, DP router, room handles, and the tasks that outlive a cancelled
block. Nothing here is public API: import from ``trio_pd`` and its public modules.
"""
