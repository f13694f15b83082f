"""Private to trio_pd: what the command line runs: the demo and the benchmarks. Nothing here is
public API: import from ``trio_pd`` and its public modules.
"""
