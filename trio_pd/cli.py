"""The ``trio-pd`` command line: ``demo``, ``bench`` and ``bootstrap``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from functools import partial
from typing import Any, NoReturn

import trio

from . import __version__
from .io import _lifeline

#: the exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (``trio-pd demo: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("not a number: nan")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be 0..65535 (0: any free port), got {value}"
        )
    return value


def _kinds(text: str) -> tuple[str, ...]:
    return tuple(k for k in text.split(",") if k)


def _common() -> argparse.ArgumentParser:
    """Options every command takes (also after the command's name)."""
    common = _Parser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
        help="trio_pd's INFO logs, and the engines' own warnings and errors, on stderr",
    )
    return common


def _demo_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .tools._demo import DemoOptions

    d = DemoOptions()
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", parents=[common], formatter_class=_Formatter,
        help="bootstrap + prefill + decode on loopback with a real engine; verifies every byte",
        description="Run N concurrent requests prefill -> decode over a real transfer engine on "
        "loopback, verify every Success byte for byte, and report. Exits 1 on any corrupt page, "
        "late write, leaked page or hung request, 130 when stopped by Ctrl-C (143 by SIGTERM; "
        "after printing what it did so far), 2 for an unusable option or an engine that is "
        "not installed.",
    )
    p.add_argument("--requests", type=int, default=d.requests, help="requests in all")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="requests in flight per rank")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument("--layers", type=int, default=d.layers, help="model layers")
    p.add_argument("--layout", choices=("mha", "mla"), default=d.layout,
                   help="KV layout: K and V per head (mha) or one latent (mla)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help=f"total KV heads (default: {d.kv_heads} for mha; mla has one latent "
                   "head, so 1)")
    p.add_argument("--head-bytes", type=int, default=d.head_bytes,
                   help="bytes of one head of one token (head_dim * dtype size)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens,
                   help="shortest prompt (tokens); lengths are drawn uniformly")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest prompt (tokens)")
    p.add_argument("--chunk-pages", type=int, default=d.chunk_pages,
                   help="pages per prefill chunk (chunked prefill)")
    p.add_argument("--page-layout", choices=("nhd", "hnd"), default=d.page_layout,
                   help="inside a page: token-major (nhd) or head-major (hnd)")
    p.add_argument("--v-head-bytes", type=int, default=None, metavar="N",
                   help="mha: the V buffers' bytes per head, when V differs from K "
                   "(default: --head-bytes)")
    p.add_argument("--page-pad", type=int, default=d.page_pad, metavar="N",
                   help="bytes between one page's end and the next's start in every buffer")
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens, metavar="N",
                   help="decode holds every request's first N tokens already (a prefix cache "
                   "hit; a multiple of --page-size): only the rest is sent")
    p.add_argument("--aux-buffers", type=int, default=d.aux_buffers, metavar="N",
                   help="aux buffers after the first (metadata buffers: rows of 24, 41, 58... "
                   "bytes), moved with every request's last chunk and verified")
    p.add_argument("--state", type=_kinds, default=",".join(d.states), metavar="KINDS",
                   dest="states",
                   help="state components of every pool, comma-separated: mamba (conv and SSM "
                   "states, a slot a request), swa (a sliding-window pool of the last 4 "
                   "pages), nsa (an index page per KV page); moved with the last chunk and "
                   "verified")
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp, help="prefill TP size")
    p.add_argument("--prefill-dp", type=int, default=d.prefill_dp, metavar="N",
                   help="prefill DP ranks (DP attention) behind one bootstrap service, each of "
                   "--prefill-tp ranks; decode routes each request to the one that holds it")
    p.add_argument("--prefill-pp", type=int, default=d.prefill_pp, metavar="S",
                   help="prefill PP stages (pipeline parallelism), each of --prefill-tp ranks "
                   "holding --layers / S layers; decode gathers every layer from its stage")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp,
                   help="decode TP size; the larger TP size must be a multiple of the smaller")
    p.add_argument("--engine", choices=("mooncake", "nixl"), default=d.engine,
                   help="transfer engine")
    p.add_argument("--device", choices=("host", "cuda"), default=d.device,
                   help="where the KV pools and aux rows live: host memory, or CUDA device 0 "
                   "(needs cuda-python, a device, and an engine build that moves device memory)")
    p.add_argument("--abort-rate", type=_number, default=d.abort_rate,
                   help="fraction of requests aborted at a random point on a random side")
    p.add_argument("--fault-rate", type=_number, default=d.fault_rate,
                   help="fraction of prefill engine calls given a fault (see --fault-kinds)")
    p.add_argument("--fault-kinds", type=_kinds, default=",".join(d.fault_kinds),
                   help="comma-separated: fail,partial,delay_before,delay_after,late")
    p.add_argument("--fault-delay", type=_number, default=d.fault_delay,
                   help="seconds the delay faults wait")
    p.add_argument("--layerwise", action="store_true",
                   help="send each chunk layer by layer, a short compute before each layer "
                   "(layer-wise streaming, docs/layerwise.md)")
    p.add_argument("--random-pages", action="store_true",
                   help="pages handed out in a random order on each side (every request's "
                   "pages scattered over the pool) instead of the allocator's first-free order")
    p.add_argument("--landing-bytes", type=_at_least(0), default=d.landing_bytes, metavar="N",
                   help="each decode rank's landing area in bytes (DecodeConfig.landing_bytes; "
                   "0: none; host pools only): scattered rooms land in few blocks and are "
                   "copied into their pages before Success; a landing page still held at the "
                   "end counts as leaked")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the request plan, aborts and faults")
    p.add_argument("--processes", action="store_true",
                   help="bootstrap, each prefill rank and each decode rank in its own process")
    p.add_argument("--secure", action="store_true",
                   help="authentication on (the default): CURVE on the control plane and a "
                        "random cluster token for the bootstrap service (docs/security.md)")
    p.add_argument("--insecure", action="store_true",
                   help="authentication off, explicitly: every agent logs a warning")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    return p


def _options(args: argparse.Namespace) -> Any:
    from .tools._demo import DemoOptions

    names = {f.name for f in fields(DemoOptions)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("kv_heads") is None:
        given["kv_heads"] = 1 if args.layout == "mla" else DemoOptions().kv_heads
    given["secure"] = not args.insecure  # (on unless turned off; --secure is the default)
    return DemoOptions(**given)


def _with_progress(total: int, quiet: bool, run: Callable[[Callable[[], None]], Any]) -> Any:
    if quiet or (not sys.stderr.isatty() and os.environ.get("TRIO_PD_PROGRESS") != "1"):
        return run(lambda: None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        transient=True, console=None,
    ) as bar:
        task = bar.add_task("requests", total=total)
        return run(lambda: bar.advance(task))


def _cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tools._demo import Interrupt, check, run_in_process, run_processes, run_sigint_aware

    if args.secure and args.insecure:
        parser.error("--secure and --insecure contradict each other")
    opts = _options(args)
    problem = opts.option_problem()
    if problem is not None:
        parser.error(problem)
    runner = run_processes if args.processes else run_in_process
    if not args.json:
        print(
            "security: on (CURVE control plane, random cluster token; docs/security.md)"
            if opts.secure else
            "security: OFF (--insecure: no CURVE, no token; docs/security.md)",
            flush=True,
        )

    interrupt = Interrupt()

    def run(tick: Callable[[], None]) -> Any:
        # Ctrl-C (or SIGTERM) stops the ranks; the summary of what they did still comes back.
        # A second one: rank processes are killed and the summary still comes; in one
        # process (nothing can be killed apart from it) the process exits at once.
        return trio.run(partial(
            run_sigint_aware, lambda stop: runner(opts, tick, interrupt=stop), interrupt,
            second="now" if args.processes else "exit",
            notice="trio-pd demo: stopping; the ranks report what they did (interrupt again "
            + ("to kill them now)" if args.processes else "to exit now)"),
        ))

    summary = _with_progress(opts.requests, args.json, run)
    problems = check(opts, summary)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        _print_summary(summary, problems, interrupt.signal)
    if interrupt.signal is not None:
        return 128 + interrupt.signal
    return 1 if problems else 0


def _print_summary(s: dict[str, Any], problems: list[str], signum: int | None = None) -> None:
    from .tools._demo import DEMO_DEVICE

    outcome = f"  succeeded {s['succeeded']}   failed {s['failed']}   aborted {s['aborted']}"
    if s.get("interrupted"):
        outcome += f"   unfinished {s['unfinished']}"
    lines = [
        f"trio_pd demo: {s['requests']} requests, engine {s['engine']}, layout {s['layout']}, "
        + (f"pools on cuda:{DEMO_DEVICE}, " if s.get("device") == "cuda" else "")
        + f"prefill TP {s['prefill_tp']} -> decode TP {s['decode_tp']}",
        outcome,
        f"  moved {s['bytes'] / 1e6:.1f} MB verified: {s['transfer_gbps']:.2f} GB/s over "
        f"{s['transfer_seconds']:.2f} s with requests in flight (union of request intervals); "
        f"{s['seconds']:.2f} s wall",
        f"  corrupt pages {s['corrupt_pages']}   late writes {s['late_writes']}   "
        f"leaked pages {s['leaked_pages']}   hung {s['hung']}",
        f"  engine errors {s['engine_errors']}   quarantined {s['quarantined']}   released after "
        f"quarantine {s['released_after_quarantine']}   released by timeout "
        f"{s['released_by_timeout']}",
    ]
    landed = sum(r.get("rooms_landed", 0) for r in s["ranks"])
    if landed or s.get("leaked_landing_pages"):
        lines.append(f"  rooms landed {landed}   leaked landing pages "
                     f"{s.get('leaked_landing_pages', 0)}")
    if s.get("failed_engine_calls"):
        lines.append(
            f"  failed engine calls {s['failed_engine_calls']}   rooms in them "
            f"{s['rooms_in_failed_calls']}   failed per failed call "
            f"{s['blast_radius']['failed_per_failed_call']:.2f}   peers marked failed "
            f"{s['peers_failed']}"
        )
    if s["abort_release_ms"]["p50"] is not None:
        lines.append(
            f"  decode abort -> pages released: p50 {s['abort_release_ms']['p50']:.2f} ms, "
            f"p99 {s['abort_release_ms']['p99']:.2f} ms"
        )
    if s.get("interrupted"):
        by = "Ctrl-C" if signum in (None, signal.SIGINT) else signal.Signals(signum).name
        lines.append(f"  interrupted ({by}): {s['unfinished']} requests unfinished"
                     + ("; PROBLEMS: " + "; ".join(problems) if problems else ""))
    else:
        lines.append("  OK" if not problems else "  PROBLEMS: " + "; ".join(problems))
    print("\n".join(lines), flush=True)


def _bench_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench", parents=[common], formatter_class=_Formatter,
        help="trio_pd vs direct engine calls on the same blocks; overhead, latency, scale",
        description="Push the blocks trio_pd plans for a workload through the bare engine "
        "(the ceiling), then run the same workload through trio_pd end to end (verified), "
        "and measure per-chunk overhead, event-loop lateness, abort -> release latency and "
        "bookkeeping memory per room at 100 / 1,000 / 10,000 rooms.",
    )
    p.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake",
                   help="transfer engine")
    p.add_argument("--device", choices=("host", "cuda"), default="host",
                   help="where every phase's KV pools and aux rows live: host memory, or CUDA "
                   "device 0 (the bare-engine ceiling then moves device memory too; needs "
                   "cuda-python, a device, and an engine build that moves device memory)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds; for tests)")
    p.add_argument("--preset", choices=("peer", "layers"), default=None,
                   help="peer: instead of the phases above, 200 requests (20 with --quick) of "
                   "32 pages x 16 buffers of 16 KiB, 8-page chunks, 8 in flight, random page "
                   "layout, with prefill and decode in separate OS processes; layers: only "
                   "the layer-wise phase, whole requests against layer by layer with a "
                   "simulated compute per layer (docs/bench.md)")
    p.add_argument("--layer-compute-ms", type=float, default=None, metavar="MS",
                   help="the layer-wise phase's simulated prefill compute per layer")
    p.add_argument("--coalesce-pages", type=_at_least(1), default=None, metavar="N",
                   help="the prefill agent's coalesce_pages (default: its own; 1: one engine "
                   "call per chunk)")
    p.add_argument("--landing-bytes", type=_at_least(0), default=None, metavar="N",
                   help="--preset peer: the decode agent's landing area in bytes "
                   "(DecodeConfig.landing_bytes; default 0: none): scattered rooms land in "
                   "few blocks and are copied into their pages before Success")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.add_argument("--plot", metavar="FILE",
                   help="write a PNG of the results (needs matplotlib: the plot extra)")
    p.add_argument("--secure", action="store_true",
                   help="authentication on (the default): CURVE control plane, cluster token")
    p.add_argument("--insecure", action="store_true",
                   help="authentication off, explicitly (to measure what it costs)")
    return p


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .tools import _bench

    if args.plot:
        problem = _bench.plot_problem(args.plot)
        if problem is not None:
            parser.error(problem)
    if args.preset == "peer":
        if args.coalesce_pages is not None:
            parser.error("--coalesce-pages does not apply to --preset peer (its prefill "
                         "process runs the agent's defaults)")
        opts = _bench.BenchOptions.peer(args.engine, quick=args.quick)
        if args.landing_bytes is not None:
            opts = replace(opts, landing_bytes=args.landing_bytes)
    else:
        if args.landing_bytes is not None:
            parser.error("--landing-bytes applies to --preset peer only")
        opts = _bench.BenchOptions.quick(args.engine) if args.quick else _bench.BenchOptions(
            engine=args.engine
        )
        if args.preset == "layers":
            opts = replace(opts, preset="layers")
    if args.layer_compute_ms is not None:
        if args.layer_compute_ms < 0:
            parser.error("--layer-compute-ms must not be negative")
        opts = replace(opts, layer_compute_ms=args.layer_compute_ms)
    if args.coalesce_pages is not None:
        opts = replace(opts, coalesce_pages=args.coalesce_pages)
    if args.secure and args.insecure:
        parser.error("--secure and --insecure contradict each other")
    opts = replace(opts, secure=not args.insecure)
    opts = replace(opts, device=args.device)
    problem = opts.option_problem()
    if problem is not None:
        parser.error(problem)
    steps = _bench.phases(opts)
    if args.json or not sys.stderr.isatty():
        result = _bench.run(opts)
    else:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("[bold]bench[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task(steps[0], total=len(steps))
            done = iter(steps[1:])

            def tick(_: str) -> None:
                bar.update(task, advance=1, description=next(done, "done"))

            result = _bench.run(opts, tick)
    problems = _bench.problems(result)
    targets = _bench.targets_line(result)
    if args.json:
        print(json.dumps(result), flush=True)
        if targets:  # (stdout is the JSON alone)
            print(targets, file=sys.stderr, flush=True)
    else:
        from rich.console import Console

        Console().print(_bench.table(result))
        if problems:
            print("PROBLEMS: " + "; ".join(problems), flush=True)
        if targets:  # (the last line)
            print(targets, flush=True)
    if args.plot:  # after the numbers are out: a plotting failure loses none of them
        _bench.plot(result, args.plot)
    return 1 if problems else 0


def _say_security_warnings() -> None:
    """Library logs are quiet (errors only) unless ``--verbose``, but security's warnings are
    said: an agent run with security off says so (one line each), and refused strangers
    are logged (rate-limited)."""
    security = logging.getLogger("trio_pd.security")
    if security.getEffectiveLevel() > logging.WARNING:
        security.setLevel(logging.WARNING)


def _bootstrap_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "bootstrap", parents=[common], formatter_class=_Formatter,
        help="run a bootstrap service; prints its URL",
        description="Serve the bootstrap service until Ctrl-C or SIGTERM (exit status 130 or "
        "143) and print its URL as the first line on stdout. The cluster token comes from "
        "TRIO_PD_TOKEN (required: the service's clients are other processes; "
        "docs/security.md).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8998, help="0: any free port")
    p.add_argument("--metrics", action="store_true",
                   help="serve the service's Prometheus metrics at GET <url>/metrics")
    p.add_argument("--insecure", action="store_true",
                   help="run open: no token required (logs a warning; docs/security.md)")
    return p


def _cmd_bootstrap(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prometheus_client import CollectorRegistry

    from .bootstrap._bootstrap import open_bootstrap_server
    from .core._errors import BootstrapError, ConfigurationError
    from .io._security import resolve
    from .tools._demo import Interrupt, run_sigint_aware

    registry = CollectorRegistry() if args.metrics else None
    secure: bool | None = False  # --insecure: the service says so itself, once
    if not args.insecure:
        try:  # (no token made in-process: every client of this service is another process)
            resolve(what="trio-pd bootstrap", hosts=[args.host], token=None, secure=None,
                    generate=False)
        except ConfigurationError as exc:
            parser.error(f"{exc}; or pass --insecure")
        secure = None

    async def serve(interrupt: Interrupt) -> int | None:
        async with open_bootstrap_server(
            args.host, args.port, metrics_registry=registry, secure=secure,
        ) as server:
            print(server.url, flush=True)
            if registry is not None:
                print(f"metrics: {server.url}/metrics", file=sys.stderr, flush=True)
            await interrupt.stop.wait()
        return interrupt.signal

    async def main() -> int | None:
        # SIGINT and SIGTERM are taken here, whatever the process inherited: a service
        # started in the background of a script inherits SIGINT ignored, and Python (so
        # trio's Ctrl-C) then leaves it ignored (seen: the service outlived `kill -INT`)
        return await run_sigint_aware(serve)

    try:
        signum = trio.run(main)
    except ConfigurationError as exc:
        parser.error(str(exc))
    except BootstrapError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    return 0 if signum is None else 128 + signum


def _interrupted(exc: BaseException) -> bool:
    """``exc`` is a KeyboardInterrupt, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(KeyboardInterrupt)[1] is None
    return isinstance(exc, KeyboardInterrupt)


def _cmd_worker(argv: Sequence[str]) -> int:
    """The hidden ``_worker`` command: one rank of ``demo --processes``."""
    from .tools._demo import DemoOptions, quiet_engine_logs, run_sigint_aware, run_worker

    w = _Parser(prog="trio-pd _worker", description="internal: one rank of demo --processes")
    w.add_argument("role", choices=("prefill", "decode"))
    w.add_argument("rank", type=int)
    w.add_argument("url")
    w.add_argument("options")
    args = w.parse_args(argv)
    quiet_engine_logs(verbose=False)  # the parent's choice, inherited, wins
    logging.basicConfig(level=logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _say_security_warnings()
    opts = DemoOptions(**json.loads(args.options))
    # the parent forwards its Ctrl-C: a second one (a terminal's, reaching the rank's
    # process group too) must not cut the rank's report short; the parent kills the rank
    # if it must
    trio.run(partial(
        run_sigint_aware,
        lambda stop: run_worker(args.role, args.rank, args.url, opts, interrupt=stop),
        second="ignore",
    ))
    return 0


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    common = _common()
    parser = _Parser(
        prog="trio-pd", formatter_class=_Formatter,
        description="trio_pd's command line: the loopback demo, the benchmark against the bare "
        "engine, and the bootstrap service. `trio-pd COMMAND --help` for each.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="trio_pd's INFO logs, and the engines' own warnings and errors, "
                        "on stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "demo": _demo_parser(sub, common),
        "bench": _bench_parser(sub, common),
        "bootstrap": _bootstrap_parser(sub, common),
    }
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-pd ARGV``; returns the exit status (argparse exits 0 for ``--help`` and
    ``--version`` and 2 for a usage error, through ``SystemExit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _lifeline.hold()  # a child of demo --processes ends with its parent
    if argv[:1] == ["_worker"]:  # internal, so not in the parser (nor in its usage text)
        try:
            return _cmd_worker(argv[1:])
        except BaseException as exc:  # a SIGINT after the rank's report, while it exits
            if not _interrupted(exc):
                raise
            return INTERRUPTED
    parser, commands = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's parser, so the line names the command
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    from .tools._demo import quiet_engine_logs

    # set before any engine exists; rank processes inherit it
    quiet_engine_logs(args.verbose)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    _say_security_warnings()
    handlers: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], int]] = {
        "demo": _cmd_demo, "bench": _cmd_bench, "bootstrap": _cmd_bootstrap,
    }
    try:
        return handlers[args.command](args, commands[args.command])
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print(f"trio-pd {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
