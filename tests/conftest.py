"""Shared test fixtures: golden-file comparison and cached exports of the reference programs."""

from __future__ import annotations

import difflib
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `programs/` is beside the package, not installed
    sys.path.insert(0, str(ROOT))
TESTS = str(ROOT / "tests")
if TESTS not in sys.path:  # export_cache, for tests in subfolders
    sys.path.insert(0, TESTS)

GOLDEN = Path(__file__).resolve().parent / "golden"


def pytest_configure(config: pytest.Config) -> None:
    """One export cache folder for the session (tests/export_cache.py): made by the first
    pytest process (with xdist, the controller, before it starts the workers that inherit it)."""
    from export_cache import ENV

    if not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="metaopt-export-cache-")
        config._metaopt_export_cache = os.environ[ENV]
    _share_the_cores(config)
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the collection's order (LPT, below)
        config.option.loadscopereorder = False
    if config.getoption("--update-file-times"):
        _SPENT["files"] = {}


def _share_the_cores(config: pytest.Config) -> None:
    """Under xdist, give each worker its share of the cores: torch's default of one OpenMP thread
    per core in every worker oversubscribes the machine, and the tests' tensors are too small to
    gain from a second thread (2 workers on 2 cores, a quarter of the suite: 361 -> 315 CPU s,
    202 -> 177 s). Set in the controller, before the workers start, so they and every process
    they start inherit it; an OMP_NUM_THREADS the user set wins."""
    workers = getattr(config.option, "numprocesses", None)
    if "OMP_NUM_THREADS" in os.environ or not isinstance(workers, int) or workers < 1:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config: pytest.Config) -> None:
    from export_cache import ENV

    folder = getattr(config, "_metaopt_export_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(ENV, None)


# Each test file's seconds in a recorded run (`pytest --update-file-times`): the order files are
# handed to the two xdist workers. With `--dist loadfile` a worker takes the next whole file when it
# is free; longest first (LPT scheduling) leaves the short files to even out the end instead of one
# worker finishing a long file alone. xdist's own order (files with the most tests first) is turned
# off for this: it put the multi-process files, which have few tests each, last.
FILE_TIMES = Path(__file__).resolve().parent / "file_times.json"


def _file_times() -> dict[str, float]:
    try:
        return json.loads(FILE_TIMES.read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    times = _file_times()

    def seconds(item: pytest.Item) -> float:
        return -times.get(item.nodeid.split("::", 1)[0], 0.0)

    items.sort(key=seconds)  # stable: each file's tests keep their order
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(
            reason="marked slow: a long case or third shape of a check the suite runs otherwise (--slow)"
        )
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the test process holds by now (torch, transformers, the collected modules) is frozen
    out of the cyclic collector's passes, and its young generation collected 14x less often:
    every test builds and drops programs of thousands of small objects, and the default
    threshold (700) collected them again and again (in-process tests 14% faster measured on
    tests/passes/test_recompute.py and test_fuse_norm_silu.py, the process 6% larger). No test
    depends on when a cycle is collected: tensors go by reference counting, and the memory
    figures are the executor's own accounting or fresh processes' RSS."""
    import gc

    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    spent = _SPENT.get("files")
    if spent is not None:
        path = report.nodeid.split("::", 1)[0]
        spent[path] = spent.get(path, 0.0) + report.duration


_SPENT: dict[str, dict[str, float]] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    spent = _SPENT.get("files")
    if spent and not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        merged = {**_file_times(), **{f: round(t, 1) for f, t in spent.items()}}  # a partial run: its files
        ordered = dict(sorted(merged.items(), key=lambda x: -x[1]))
        FILE_TIMES.write_text(json.dumps(ordered, indent=0) + "\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/ files from the current output (say why in the commit)",
    )
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (the suite's default leaves them out to stay under 10 min)",
    )
    parser.addoption(
        "--update-file-times",
        action="store_true",
        default=False,
        help="record each test file's seconds in tests/file_times.json (the order xdist hands files out)",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """golden("pass/case", text): compare with tests/golden/pass/case.txt (unified diff)."""
    update = request.config.getoption("--update-golden")

    def check(case: str, text: str) -> None:
        path = GOLDEN / f"{case}.txt"
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"no golden file {path.relative_to(ROOT)}; run pytest --update-golden to create it")
        want = path.read_text()
        if text != want:
            diff = "".join(
                difflib.unified_diff(
                    want.splitlines(True), text.splitlines(True), f"golden/{case}.txt", "actual", n=2
                )
            )
            pytest.fail(f"program differs from golden/{case}.txt:\n{diff[:20000]}")

    return check


@functools.cache
def exported(name: str, config: str = "tiny", dropout: float = 0.0, batch: int = 4):
    """(module, inputs, program) for a reference program; cached: exports take seconds."""
    import export_cache

    import programs

    mod = programs.get(name)
    overrides = {"dropout": dropout} if dropout is not None else {}
    module = mod.build(config, seed=0, **overrides)
    inputs = mod.example_inputs(config, batch, seed=1)
    program = export_cache.export(module, inputs, name=name)
    return module, inputs, program


def backward_links(program) -> dict:
    """What append_backward handed on, recovered from a training program by the naming
    convention (tests only: passes get these from the driver's context): each param's grad
    and the loss grad's seed."""
    from metaopt.ir import names

    grads = {v.name: names.grad(v.name) for v in program.params() if names.grad(v.name) in program.vars}
    return {"grads": grads, "loss_grad": names.grad(program.loss_name)}


def pipeline_split(program, **how) -> list:
    """passes.pipeline.pipeline with the backward's links of `program` (see backward_links), each
    stage program's fused grad ops split for a zero-bubble schedule (passes.split_weight_grads)
    and cut into its phases (passes.pipeline_phases), as minimize leaves it."""
    from metaopt.passes.pipeline import pipeline
    from metaopt.passes.pipeline_phases import pipeline_phases
    from metaopt.passes.split_weight_grads import split_weight_grads

    stages = pipeline(program, **how, **backward_links(program))
    return [pipeline_phases(split_weight_grads(q)) for q in stages]


# What a launcher sets; a test of fleet's own environment handling starts without any of it.
WORKER_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT",
    "METAOPT_COMM_TIMEOUT",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and fleet's state forgotten before and after the test."""
    for name in WORKER_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    from metaopt.fleet import env

    env.reset()
    yield
    env.reset()


def tiny_program():
    """x [batch, 4] @ w [4, 3], mean: the smallest trainable program (fleet's API tests)."""
    import torch

    from metaopt.ir import Op, Program, Var

    p = Program("tiny")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), torch.randn(4, 3))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    p.ops = [Op("MatMul", ["x", "w"], ["h"]), Op("ReduceMean", ["h"], ["loss"], {"keepdims": 0}, role="loss")]
    return p
