"""Private to trio_pd: the bootstrap service, split by concern, and its client. Nothing here is
public API: import from ``trio_pd`` and its public modules.
"""
