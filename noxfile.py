"""Sessions for trio_pd. They run in the current environment (set up by ./dev).

    ./dev nox -s lint typecheck tests
    ./dev nox -s soak
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "typecheck", "tests"]


def _py_files(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).rglob("*.py"))


@nox.session
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", "trio_pd", "tests", "noxfile.py")
    # ruff lacks ASYNC910/911/912 (checkpoint-on-every-path rules); flake8-async has them.
    session.run("flake8-async", "--enable=ASYNC910,ASYNC911,ASYNC912", *_py_files("trio_pd"))


@nox.session
def typecheck(session: nox.Session) -> None:
    session.run("mypy")


#: what the default suite leaves to other sessions
DEFAULT = "not slow and not gpu and not chaos and not fuzz and not sglang"
#: pytest-xdist workers for the parallel pass: the suite mostly waits on sockets, engines and
#: deadlines, so more workers than this 2-core box has cores still shorten it
WORKERS = "4"


@nox.session
def tests(session: nox.Session) -> None:
    """The full suite, both engines; GPU tests skip without a device. Two passes: every test
    but those marked ``serial`` on several workers (pytest-xdist), then the ``serial`` ones
    alone (they assert on elapsed time, CPU or a deadline's margin, which a crowded box would
    skew). Arguments go to both passes; a pass that selects nothing is not a failure."""
    common = ["pytest", "-q", "-p", "no:cacheprovider", "--durations=10"]
    session.run(*common, "-n", WORKERS, "-m", f"{DEFAULT} and not serial", *session.posargs,
                success_codes=[0, 5])
    session.run(*common, "-m", f"{DEFAULT} and serial", *session.posargs,
                success_codes=[0, 5])


@nox.session
def chaos(session: nox.Session) -> None:
    """Faults across processes and network namespaces (docs/reliability.md); `-- -k short`
    is the short run .ci/run makes."""
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-m", "chaos", "-rs", "tests/chaos",
                *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Generated hostile input at volume (docs/reliability.md, "Fuzzing"): the wire decoders
    (1,000,000 inputs), live listeners with real traffic, the bootstrap service. `-- -k short`
    runs the quick variants; without arguments, the full ones."""
    args = session.posargs or ["-k", "not short"]
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-m", "fuzz", "tests/fuzz", *args)


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """Every gpu-marked test (tests/test_gpu.py: engines and agents on CUDA device pools).
    Without a device they all skip and the session passes; so does pytest's exit code 5 (no
    test collected, e.g. `-- -k` matched none). With TRIO_PD_REQUIRE_GPU=1 nothing skips: a
    missing device or GPU build of an engine fails (tools/gpu-check sets it)."""
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", *session.posargs,
        success_codes=[0, 5],
    )


@nox.session
def soak(session: nox.Session) -> None:
    """Long demo runs full of aborts and faults, on both engines."""
    for engine in ("mooncake", "nixl"):
        session.run(
            "trio-pd", "demo", "--engine", engine, "--requests", "2000",
            "--abort-rate", "0.3", "--fault-rate", "0.05", "--json", *session.posargs,
        )


@nox.session
def bench(session: nox.Session) -> None:
    """trio_pd vs direct engine calls; pass --json, --plot FILE, --engine nixl, --quick."""
    session.run("trio-pd", "bench", *session.posargs)


#: what `nox -s sglang` installs beside trio_pd: SGLang 0.5.23 without its GPU dependency
#: tree, torch's CPU build (pip takes the wheel the machine keeps), and the modules SGLang's
#: PD scheduler code imports (found by importing it and reading the errors)
SGLANG = "sglang==0.5.23"
SGLANG_IMPORTS = [
    "torch==2.13.0", "transformers==5.19.0", "orjson", "psutil", "pybase64", "triton",
    "starlette", "pydantic", "tqdm", "ipython", "httpx2", "truststore", "dill",
    "apache-tvm-ffi==0.1.11", "sentencepiece", "compressed-tensors", "loguru", "gguf",
    "openai", "partial-json-parser", "einops", "pillow",
]


def _sglang_venv(session: nox.Session) -> str:
    """The python of .nox/sglang-venv (trio_pd from this tree, torch's CPU build, SGLang
    with --no-deps and the few modules its PD code imports), built on first use and again
    when what it installs changes."""
    venv = Path(".nox/sglang-venv")
    py = str(venv / "bin" / "python")
    stamp = venv / ".installed"
    wanted = "\n".join([SGLANG, *SGLANG_IMPORTS, Path("pyproject.toml").read_text()])
    if not stamp.exists() or stamp.read_text() != wanted:
        session.run("python3", "-m", "venv", "--clear", str(venv), external=True)
        pip = [py, "-m", "pip", "install", "-q"]
        session.run(*pip, "-U", "pip", external=True)
        session.run(*pip, "-e", ".[cpu,nixl,test]", *SGLANG_IMPORTS, external=True)
        session.run(*pip, "--no-deps", "nixl-cu12>=1.5", SGLANG, external=True)
        stamp.write_text(wanted)
    return py


@nox.session
def sglang(session: nox.Session) -> None:
    """The conformance suite against SGLang 0.5.23's own scheduler code (tests/sglang):
    every call SGLang makes on the connector objects, listed from its installed source and
    checked against the adapter's table, and SGLang's prefill and decode queues moving
    verified requests with aborts over both engines. Runs in .nox/sglang-venv (built on
    first use, a few minutes; a second run reuses it)."""
    py = _sglang_venv(session)
    session.run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sglang", "-rs",
                "tests/sglang", *session.posargs, external=True,
                env={"TRIO_PD_REQUIRE_SGLANG": "1"})


@nox.session
def sglang_calls(session: nox.Session) -> None:
    """The part of `nox -s sglang` that needs SGLang's source only (what .ci/run runs):
    SGLang 0.5.23's wheel alone, unpacked with --no-deps (no torch) into .nox/sglang-source,
    and the tests that read it with ast: the call list against the adapter's table, the
    flags it refuses, the variables and server arguments it reads, its plugin's hook
    targets. The tests that run SGLang's code are skipped here (-rs lists them)."""
    target = Path(".nox/sglang-source")
    stamp = target / ".installed"
    if not stamp.exists() or stamp.read_text() != SGLANG:
        session.run("python", "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), SGLANG)
        stamp.write_text(SGLANG)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-m", "sglang", "-rs",
                "tests/sglang", *session.posargs,
                env={"TRIO_PD_REQUIRE_SGLANG": "1", "TRIO_PD_SGLANG_SOURCE": str(target)})


@nox.session
def sglang_bench(session: nox.Session) -> None:
    """SGLang's own Mooncake classes against trio_pd.compat.sglang in SGLang's scheduler
    shape (tools/sglang_bench.py; docs/bench.md): the ranks run in .nox/sglang-venv (built
    as for `nox -s sglang`), the tool itself here (it plots with matplotlib). Pass the
    tool's options after --, e.g. `-- --runs 5 --json out.json --plot out.png`."""
    py = _sglang_venv(session)
    session.run("python", "tools/sglang_bench.py", "--python", py, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation: the pages' code snippets run (tests/test_docs.py), then the site
    (mkdocs-material, with the API reference generated from the docstrings by mkdocstrings)
    is built into build/site, strict: any warning fails the session."""
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py", *session.posargs)
    session.run("mkdocs", "build", "--strict", "-q", env={"NO_MKDOCS_2_WARNING": "1"})
