"""Private to trio_pd: the I/O the agents stand on: ZeroMQ from trio, the control channel and its
outbox, engine lanes, the one timer task per agent, the kernel's send-queue proof, liveness
probes, authentication, host name resolution, the descriptor budget, CUDA copies, child process
lifelines. Nothing here is public API: import from ``trio_pd`` and its public modules.
"""
