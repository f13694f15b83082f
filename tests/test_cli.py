"""The ``trio-pd`` command line as a user meets it: option errors, Ctrl-C, ``--version``,
``--help``, ``python -m trio_pd``, ``bootstrap --metrics``, quiet engine logs, the demo's
throughput line, ``bench --plot`` checks, and the package metadata behind them.

Option errors are checked through :func:`trio_pd.cli.main` in this process, with the demo,
bench and bootstrap runners replaced by ones that fail the test: a bad option must be refused
before anything starts. The rest run the CLI as a subprocess.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

import trio_pd
from trio_pd import KVPoll, cli
from trio_pd.bootstrap import _bootstrap
from trio_pd.bootstrap._bootstrap_client import TokenProof
from trio_pd.tools import _bench, _demo

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ helpers


#: cli.main sets engine log variables (GLOG_minloglevel): keep them out of other tests
pytestmark = pytest.mark.usefixtures("keep_environ")


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace what a command would start with something that fails the test."""

    def started(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the command started running despite a bad option")

    for module, name in ((_demo, "run_in_process"), (_demo, "run_processes"), (_bench, "run"),
                         (_bootstrap, "serve_bootstrap")):
        monkeypatch.setattr(module, name, started)


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else 1


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], command: str) -> str:
    """Run ``trio-pd ARGV``; assert one ``trio-pd COMMAND: error: ...`` line and exit 2."""
    rc = _main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"trio-pd {command}: error: "), err
    return lines[0]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_pd", *args]


# ------------------------------------------------------------------ options refused up front


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--decode-tp", "3", "--prefill-tp", "2"], "multiple"),
        (["--prefill-tp", "4", "--kv-heads", "6"], "--kv-heads"),
        (["--prefill-tp", "0"], "--prefill-tp"),
        (["--decode-tp", "2000"], "--decode-tp"),
        (["--layout", "mla", "--kv-heads", "8"], "MLA"),
        (["--requests", "-5"], "--requests"),
        (["--requests", "0"], "--requests"),
        (["--requests", "abc"], "--requests"),
        (["--bogus"], "--bogus"),
        (["--chunk-pages", "0"], "--chunk-pages"),
        (["--layers", "0"], "--layers"),
        (["--abort-rate", "2"], "--abort-rate"),
        (["--abort-rate", "-0.1"], "--abort-rate"),
        (["--abort-rate", "nan"], "--abort-rate"),
        (["--fault-rate", "1.5"], "--fault-rate"),
        (["--fault-rate", "-1"], "--fault-rate"),
        (["--fault-kinds", "fail,explode"], "--fault-kinds"),
        # nothing in the demo releases a stalled call: the run would never end
        (["--fault-kinds", "fail,stall", "--fault-rate", "0.1"], "stall"),
        (["--landing-bytes", "-1"], "--landing-bytes"),
        (["--fault-delay", "-1"], "--fault-delay"),
        (["--fault-delay", "inf"], "--fault-delay"),
        (["--concurrency", "0"], "--concurrency"),
        (["--page-size", "0"], "--page-size"),
        (["--kv-heads", "0"], "--kv-heads"),
        (["--head-bytes", "0"], "--head-bytes"),
        (["--min-tokens", "0"], "--min-tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--min-tokens", "100", "--max-tokens", "10"], "--max-tokens"),
        (["--concurrency", "100000", "--max-tokens", "10000000"], "memory"),
    ],
)
def test_demo_refuses_bad_options(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(["demo", *argv], capsys, "demo")
    assert says in line, line


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_bootstrap_refuses_bad_port(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["bootstrap", "--port", port], capsys, "bootstrap")
    assert "--port" in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_bench_refuses_bad_coalesce_pages(capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["bench", "--quick", "--coalesce-pages", "0"], capsys, "bench")
    assert "--coalesce-pages" in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_bench_plot_needs_a_writable_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no-such-folder" / "bench.png"
    line = _refused(["bench", "--quick", "--plot", str(target)], capsys, "bench")
    assert "no-such-folder" in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_bench_plot_needs_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    line = _refused(["bench", "--quick", "--plot", str(tmp_path / "b.png")], capsys, "bench")
    assert "matplotlib" in line, line


#: the module each engine's adapter imports; None in sys.modules makes its import fail
_ENGINE_MODULES = {"mooncake": ("mooncake", "mooncake.engine"), "nixl": ("nixl_cu12",)}


def _hide(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """Make ``engine``'s module look not installed (as after ``pip install trio-pd``)."""
    for module in _ENGINE_MODULES[engine]:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("engine", "argv", "install"),
    [
        ("nixl", ["demo", "--engine", "nixl"], "pip install --no-deps nixl-cu12"),
        ("nixl", ["demo", "--engine", "nixl", "--processes"], "pip install --no-deps nixl-cu12"),
        ("mooncake", ["demo"], "pip install 'trio-pd[cpu]'"),
        ("nixl", ["bench", "--quick", "--engine", "nixl"], "pip install --no-deps nixl-cu12"),
        ("mooncake", ["bench", "--quick", "--preset", "peer"], "pip install 'trio-pd[cpu]'"),
    ],
)
def test_a_missing_engine_module_is_one_line_with_the_install_hint(
    engine: str, argv: list[str], install: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command that builds an engine refuses a missing one up front: one line that
    says what to install, exit 2 (before: a 120-line traceback, exit 1)."""
    _hide(monkeypatch, engine)
    line = _refused(argv, capsys, argv[0])
    assert f"--engine {engine}: " in line and install in line, line


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_make_engine_without_its_module_raises_configuration_error(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library user gets the same hint from ``make_engine``, as a ConfigurationError."""
    from trio_pd import ConfigurationError
    from trio_pd.engines import make_engine

    _hide(monkeypatch, engine)
    with pytest.raises(ConfigurationError, match=r"pip install .*trio-pd"):
        make_engine(engine)


def test_bench_prints_json_before_plotting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = {"ratio": 1.0, "note": "stand-in"}
    seen: list[str] = []

    def plot(r: dict[str, Any], path: str) -> None:
        seen.append(capsys.readouterr().out)

    monkeypatch.setattr(_bench, "run", lambda opts, progress=None: result)
    monkeypatch.setattr(_bench, "problems", lambda r: [])
    monkeypatch.setattr(_bench, "plot", plot)
    assert _main(["bench", "--quick", "--json", "--plot", str(tmp_path / "b.png")]) == 0
    assert len(seen) == 1 and json.loads(seen[0]) == result


@pytest.mark.parametrize("json_out", [True, False])
def test_bench_names_the_targets_it_missed(
    json_out: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missed target is said in one line: after the table, or on stderr with ``--json``
    (stdout stays the JSON alone). A target the run could not judge (None) is not counted."""
    result = {"targets": {"ratio>=0.9": True, "10k_rooms<=4KiB/room": False,
                          "loop_cpu<=250us/request": False, "facades<=300us/request": None}}
    monkeypatch.setattr(_bench, "run", lambda opts, progress=None: result)
    monkeypatch.setattr(_bench, "problems", lambda r: [])
    monkeypatch.setattr(_bench, "table", lambda r: "(the table)")
    assert _main(["bench", "--quick"] + (["--json"] if json_out else [])) == 0
    out, err = capsys.readouterr()
    line = ("targets: 1 of 3 met; missed: 10k_rooms<=4KiB/room, "
            "loop_cpu<=250us/request")
    if json_out:
        assert json.loads(out) == result and line in err.splitlines()
    else:
        assert out.splitlines()[-1] == line
    assert _bench.targets_line({"targets": {"ratio>=0.9": True}}) == "targets: 1 of 1 met"
    assert _bench.targets_line({"preset": "peer"}) is None


# ------------------------------------------------------------------ help, version, entry points


def test_version_comes_from_the_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert importlib.metadata.version("trio-pd") == pyproject["project"]["version"]
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "9.9.9" if name == "trio-pd" else real(name)
    )
    try:
        importlib.reload(trio_pd)
        assert trio_pd.__version__ == "9.9.9"
    finally:
        monkeypatch.undo()
        importlib.reload(trio_pd)
    assert trio_pd.__version__ == pyproject["project"]["version"]


def test_version_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"trio-pd {trio_pd.__version__}"


def test_help_shows_defaults_and_no_internal_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "_worker" not in top and "SUPPRESS" not in top, top
    assert _main(["demo", "--help"]) == 0
    demo = capsys.readouterr().out
    assert re.search(r"--requests REQUESTS\s+.*\(default: 200\)", demo, re.DOTALL), demo
    assert "(default: 0.0)" in demo and "(default: mooncake)" in demo, demo
    assert _main(["no-such-command"]) == 2
    assert "_worker" not in capsys.readouterr().err


def test_python_dash_m_trio_pd() -> None:
    proc = subprocess.run(_cli("--version"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"trio-pd {trio_pd.__version__}"


# ------------------------------------------------------------------ commands that run


def test_bootstrap_needs_a_shared_token_or_insecure() -> None:
    """``trio-pd bootstrap`` serves other processes: it makes no token of its own. Without
    ``TRIO_PD_TOKEN`` it refuses to start, naming the variable and ``--insecure``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRIO_PD_TOKEN", "TRIO_PD_SECURE")}
    done = subprocess.run(_cli("bootstrap", "--port", "0"), capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2, done
    assert "TRIO_PD_TOKEN" in done.stderr and "--insecure" in done.stderr, done.stderr


def _ignore_sigint() -> None:
    """In the child before exec: SIGINT ignored, as a script's background job inherits it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("signum", "inherited"),
    [(signal.SIGINT, "default"), (signal.SIGINT, "ignored"), (signal.SIGTERM, "default")],
    ids=["ctrl-c", "sigint-inherited-ignored", "sigterm"],
)
def test_bootstrap_metrics_and_stop(signum: signal.Signals, inherited: str) -> None:
    """``trio-pd bootstrap --metrics`` serves its metrics, and SIGINT or SIGTERM stops it
    (exit 128 + the signal), also when it inherited SIGINT ignored (a service started in a
    script's background: Python leaves an ignored SIGINT ignored, and the service used to
    outlive ``kill -INT``)."""
    # (-X faulthandler: a process that outlives the signal shows its threads' stacks below)
    argv = [sys.executable, "-X", "faulthandler", *_cli("bootstrap", "--port", "0",
                                                          "--metrics")[1:]]
    env = {**os.environ, "TRIO_PD_TOKEN": "cli-test-token"}
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_ignore_sigint if inherited == "ignored" else None,
    ) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:"), url
            reply = httpx.get(url + "/metrics", timeout=10)
            assert reply.status_code == 200, reply.text
            assert "trio_pd_bootstrap_requests" in reply.text, reply.text
            proc.send_signal(signum)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every stack, then dies
                _, err = proc.communicate(timeout=10)
                raise AssertionError(f"no exit 30 s after {signum.name}:\n{err}") from None
            assert proc.returncode == 128 + signum and "Traceback" not in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("mode", [[], ["--processes"]], ids=["in-process", "processes"])
def test_ctrl_c_prints_partial_summary_and_exits_130(mode: list[str]) -> None:
    """SIGINT to a running demo: it stops, prints what it has, and exits 130."""
    proc = subprocess.Popen(
        _cli("demo", "--requests", "200000", *mode),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the security line, printed just before the run
        assert first.startswith("security:"), first
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()  # only this PID; its rank processes exit when their pipes close
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert "trio_pd demo: 200000 requests" in out, out
    assert re.search(r"interrupted .*: \d+ requests unfinished", out), out


def _started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if it is gone or a
    zombie (dead, not yet reaped): with the PID this names one process, whatever reuses
    the number later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _children(pid: int) -> dict[int, int]:
    """The live child processes of ``pid``: PID -> start time."""
    kids = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            started = _started_at(int(entry.name))
            if int(fields[1]) == pid and started is not None:
                kids[int(entry.name)] = started
    return kids


def _bootstrap_url(kids: dict[int, int]) -> str | None:
    """The bootstrap URL on a rank process's command line (``_worker ROLE RANK URL ...``)."""
    for pid in kids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"_worker" in argv:
            return argv[argv.index(b"_worker") + 3].decode()
    return None


def _cluster_token(kids: dict[int, int]) -> str:
    """The cluster token the demo gave its processes (``TRIO_PD_TOKEN`` in their
    environment: never on a command line)."""
    for pid in kids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"TRIO_PD_TOKEN="):
                return entry.split(b"=", 1)[1].decode()
    raise AssertionError("no rank process holds TRIO_PD_TOKEN")


@pytest.mark.parametrize(
    "signals", [("SIGINT", "SIGINT"), ("SIGTERM",), ("SIGKILL",)],
    ids=["ctrl-c-twice", "sigterm", "sigkill"],
)
def test_no_child_outlives_the_demo_however_it_is_stopped(signals: tuple[str, ...]) -> None:
    """``demo --processes`` stopped while its ranks run, by two Ctrl-Cs, SIGTERM or
    SIGKILL: no child process (bootstrap service, ranks) is left running, checked by PID
    (before: the bootstrap service went on listening with parent 1, and rank processes
    spilled BrokenPipeError tracebacks). Stopped by a signal it can catch, it prints its
    partial summary once and exits 128 + the first signal, with no traceback. The second
    Ctrl-C goes once the first was taken (it prints a notice): trio delivers a signal that
    arrives again before the first was taken once."""
    proc = subprocess.Popen(
        _cli("demo", "--processes", "--requests", "200000"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    kids: dict[int, int] = {}
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("security:")
        deadline = time.monotonic() + 60
        url = None
        while url is None or len(kids) < 3:  # the bootstrap service and two ranks
            assert time.monotonic() < deadline, f"the demo's processes did not start: {kids}"
            time.sleep(0.1)
            kids = _children(proc.pid)
            url = _bootstrap_url(kids)
        proof = TokenProof(_cluster_token(kids))  # (security is on: the demo's own token)
        while httpx.get(url + "/route", timeout=10, auth=proof).status_code != 200:
            assert time.monotonic() < deadline, "the prefill rank did not register"
            time.sleep(0.1)
        assert proc.stderr is not None
        heard = ""
        for name in signals:
            proc.send_signal(getattr(signal, name))
            if name != signals[-1]:  # a second signal must come after the first was taken
                while "trio-pd demo: stopping" not in heard:
                    heard += proc.stderr.readline() or pytest.fail(f"no notice: {heard}")
        out, err = proc.communicate(timeout=60)  # (the children hold its stderr too)
        err = heard + err
        deadline = time.monotonic() + 20
        left = kids
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = {pid: t for pid, t in kids.items() if _started_at(pid) == t}
        assert not left, f"child processes outlived the demo: {sorted(left)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, started in kids.items():  # a failed run leaves nothing behind either
            if _started_at(pid) == started:
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in err, err[-3000:]
    first = getattr(signal, signals[0])
    if first == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 128 + first, (proc.returncode, out, err[-3000:])
    assert out.count("trio_pd demo: 200000 requests") == 1, out
    assert re.search(r"interrupted .*: \d+ requests unfinished", out), out


def test_demo_headline_and_quiet_engine_logs() -> None:
    """The throughput line divides by the time requests were in flight, and a healthy run
    shows none of the engine's own log lines (Mooncake logs an error on every start)."""
    proc = subprocess.run(_cli("demo", "--requests", "40"), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Local segment descriptor not found" not in proc.stderr, proc.stderr
    assert not re.search(r"^[IWE]\d{4} ", proc.stderr, re.MULTILINE), proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("moved"))
    m = re.fullmatch(
        r"\s+moved ([\d.]+) MB verified: ([\d.]+) GB/s over ([\d.]+) s with requests in "
        r"flight \(union of request intervals\); ([\d.]+) s wall", line)
    assert m, line
    in_flight, wall = float(m.group(3)), float(m.group(4))
    assert 0 < in_flight <= wall, line


def test_verbose_keeps_engine_warnings() -> None:
    proc = subprocess.run(_cli("-v", "demo", "--requests", "2"), capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Local segment descriptor not found" in proc.stderr, proc.stderr


def test_transfer_time_is_the_union_of_request_intervals() -> None:
    opts = _demo.DemoOptions(requests=3)
    done = dict.fromkeys(range(3), int(KVPoll.Success))
    d0 = _demo.RankResult("decode", 0, outcomes=dict(done), bytes=3_000_000_000,
                          active=[(10.0, 11.0), (10.5, 12.0)])
    d1 = _demo.RankResult("decode", 1, outcomes=dict(done), active=[(13.0, 14.0)])
    s = _demo.summarize(opts, [d0, d1], 10.0)
    assert s["seconds"] == 10.0 and s["gbps"] == 0.3
    assert s["transfer_seconds"] == 3.0 and s["transfer_gbps"] == 1.0


# ------------------------------------------------------------------ packaging


def test_package_metadata() -> None:
    meta = importlib.metadata.metadata("trio-pd")
    assert meta["License-Expression"] == "MIT"
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    assert meta.get_all("Classifier")
    requires = importlib.metadata.requires("trio-pd") or []
    trio_req = next(r for r in requires if re.match(r"trio\b(?!-)", r))
    assert "==" not in trio_req, trio_req
    for req in requires:
        if req.startswith("matplotlib"):
            assert 'extra == "plot"' in req, req


def test_explorer_names_the_trio_version_it_was_checked_against(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The schedule explorer uses private trio names: on another trio it says so."""
    import trio

    from trio_pd.testing import explore, explorer

    async def scenario() -> None:
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(trio, "__version__", "0.99.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explore(scenario)
    texts = [str(w.message) for w in caught]
    assert any("0.99.0" in t and explorer.CHECKED_TRIO in t for t in texts), texts
