"""The ``trio-pd`` command line: ``demo``, ``bench`` and ``bootstrap``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any

import trio


def _demo_parser(sub: Any) -> None:
    from ._demo import DemoOptions

    d = DemoOptions()
    p = sub.add_parser(
        "demo",
        help="bootstrap + prefill + decode on loopback with a real engine; verifies every byte",
        description="Run N concurrent requests prefill -> decode over a real transfer engine on "
        "loopback, verify every Success byte for byte, and report. Exits 1 on any corrupt page, "
        "late write, leaked page or hung request.",
    )
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--layout", choices=("mha", "mla"), default=d.layout)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="total KV heads (MHA)")
    p.add_argument("--head-bytes", type=int, default=d.head_bytes,
                   help="bytes of one head of one token (head_dim * dtype size)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--chunk-pages", type=int, default=d.chunk_pages,
                   help="pages per prefill chunk (chunked prefill)")
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp)
    p.add_argument("--decode-tp", type=int, default=d.decode_tp)
    p.add_argument("--engine", choices=("mooncake", "nixl"), default=d.engine)
    p.add_argument("--abort-rate", type=float, default=d.abort_rate,
                   help="fraction of requests aborted at a random point on a random side")
    p.add_argument("--fault-rate", type=float, default=d.fault_rate,
                   help="fraction of prefill engine calls given a fault (see --fault-kinds)")
    p.add_argument("--fault-kinds", type=lambda v: tuple(v.split(",")), default=d.fault_kinds,
                   help="comma-separated: fail,partial,delay_before,delay_after")
    p.add_argument("--fault-delay", type=float, default=d.fault_delay,
                   help="seconds the delay faults wait")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--processes", action="store_true",
                   help="bootstrap, each prefill rank and each decode rank in its own process")
    p.add_argument("--secure", action="store_true",
                   help="authentication on: CURVE on the control plane and a random cluster "
                        "token for the bootstrap service (docs/security.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")


def _options(args: argparse.Namespace) -> Any:
    from ._demo import DemoOptions

    names = {f.name for f in fields(DemoOptions)}
    return DemoOptions(**{k: v for k, v in vars(args).items() if k in names})


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import check, run_in_process, run_processes

    opts = _options(args)
    runner = run_processes if args.processes else run_in_process
    if not args.json:
        print(
            "security: on (CURVE control plane, random cluster token; docs/security.md)"
            if opts.secure else
            "security: off (loopback demo runs open: no CURVE, no token; --secure turns "
            "them on; docs/security.md)",
            flush=True,
        )
    summary = _with_progress(opts.requests, args.json, lambda tick: trio.run(runner, opts, tick))
    problems = check(opts, summary)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, problems)
    return 1 if problems else 0


def _print_summary(s: dict[str, Any], problems: list[str]) -> None:
    lines = [
        f"trio_pd demo: {s['requests']} requests, engine {s['engine']}, layout {s['layout']}, "
        f"prefill TP {s['prefill_tp']} -> decode TP {s['decode_tp']}",
        f"  succeeded {s['succeeded']}   failed {s['failed']}   aborted {s['aborted']}",
        f"  moved {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.2f} s "
        f"({s['gbps']:.2f} GB/s verified)",
        f"  corrupt pages {s['corrupt_pages']}   late writes {s['late_writes']}   "
        f"leaked pages {s['leaked_pages']}   hung {s['hung']}",
        f"  engine errors {s['engine_errors']}   quarantined {s['quarantined']}   released after "
        f"quarantine {s['released_after_quarantine']}   released by timeout "
        f"{s['released_by_timeout']}",
    ]
    if s["abort_release_ms"]["p50"] is not None:
        lines.append(
            f"  decode abort -> pages released: p50 {s['abort_release_ms']['p50']:.2f} ms, "
            f"p99 {s['abort_release_ms']['p99']:.2f} ms"
        )
    lines.append("  OK" if not problems else "  PROBLEMS: " + "; ".join(problems))
    print("\n".join(lines))


def _bench_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="trio_pd vs direct engine calls on the same blocks; overhead, latency, scale",
        description="Push the blocks trio_pd plans for a workload through the bare engine "
        "(the ceiling), then run the same workload through trio_pd end to end (verified), "
        "and measure per-chunk overhead, event-loop lateness, abort -> release latency and "
        "bookkeeping memory per room at 100 / 1,000 / 10,000 rooms.",
    )
    p.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds; for tests)")
    p.add_argument("--coalesce-pages", type=int, default=None, metavar="N",
                   help="the prefill agent's coalesce_pages (default: its own; 1: one engine "
                   "call per chunk)")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the results (matplotlib)")
    p.add_argument("--secure", action="store_true",
                   help="authentication on: CURVE control plane, cluster token")


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import _bench

    opts = _bench.BenchOptions.quick(args.engine) if args.quick else _bench.BenchOptions(
        engine=args.engine
    )
    if args.coalesce_pages is not None:
        if args.coalesce_pages < 1:
            raise SystemExit("trio-pd bench: --coalesce-pages must be at least 1")
        opts = replace(opts, coalesce_pages=args.coalesce_pages)
    if args.secure:
        opts = replace(opts, secure=True)
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
    if args.plot:
        _bench.plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        from rich.console import Console

        Console().print(_bench.table(result))
    problems = _bench.problems(result)
    if problems and not args.json:
        print("PROBLEMS: " + "; ".join(problems))
    return 1 if problems else 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from ._bootstrap import serve_bootstrap

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_bootstrap, args.host, args.port)
            print(server.url, flush=True)

    trio.run(main)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from ._demo import DemoOptions, run_worker

    raw = json.loads(args.options)
    opts = DemoOptions(**raw)
    trio.run(run_worker, args.role, args.rank, args.url, opts)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trio-pd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _bench_parser(sub)
    b = sub.add_parser("bootstrap", help="run a bootstrap service; prints its URL")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=8998)
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("role", choices=("prefill", "decode"))
    w.add_argument("rank", type=int)
    w.add_argument("url")
    w.add_argument("options")
    args = parser.parse_args(argv)
    # Mooncake logs every connection through glog on stderr; keep warnings and errors only
    # unless asked (read when the engine library loads, so set before any engine exists).
    if not args.verbose:
        os.environ.setdefault("GLOG_minloglevel", "1")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "demo": _cmd_demo, "bench": _cmd_bench, "bootstrap": _cmd_bootstrap, "_worker": _cmd_worker,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
