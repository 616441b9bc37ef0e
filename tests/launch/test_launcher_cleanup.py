"""No process of a job outlives it: workers and every kind of child they start, after a
failed worker, a successful job, SIGTERM / SIGINT to the launcher and SIGKILL of it.

Each worker starts the children a training script plausibly leaves behind, records every
pid in pids/, then the test ends the job and polls /proc (bounded) until none is alive.
Linux only: the guarantees rest on /proc, process sessions and prctl.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_launcher import _alive, _cmd, _env

from metaopt.launch import _reaper

pytestmark = pytest.mark.skipif(not _reaper.HAVE_PROC, reason="needs Linux /proc")

GONE_WITHIN_S = 10
START_TIMEOUT_S = 60

# argv: MODE [hidden] [deaf_worker]. MODE "fail": rank 1 exits 1 once the file `go` exists;
# "exit": every rank exits 0 at once; "sleep": every rank sleeps. "hidden" adds a child that
# both leaves the session and drops the environment (found through the launcher's ancestry,
# and after its death through the job's cgroup). "deaf_worker": the worker ignores SIGTERM.
FAMILY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    rank = os.environ["RANK"]
    mode = sys.argv[1]
    os.makedirs("pids", exist_ok=True)

    def record(name, pid):
        path = f"pids/{rank}.{name}"
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(path + ".tmp", path)  # the test must never read a half-written file

    def spawn(name, **kw):
        record(name, subprocess.Popen(["sleep", "1000"], **kw).pid)

    def daemon():  # the classic double fork: the grandchild is orphaned, in a session of its own
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                record("daemon", os.getpid())
                os.execvp("sleep", ["sleep", "1000"])
            os._exit(0)
        os.waitpid(pid, 0)

    record("worker", os.getpid())
    if "deaf_worker" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spawn("plain")  # in the worker's process group
    spawn("deaf", preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))  # only SIGKILL ends it
    spawn("own_group", preexec_fn=os.setpgrp)  # left the group, still in the session
    spawn("own_session", start_new_session=True)
    if "hidden" in sys.argv:
        spawn("hidden", start_new_session=True, env={"PATH": os.environ["PATH"]})
    daemon()
    while not os.path.exists(f"pids/{rank}.daemon"):
        time.sleep(0.01)
    record("ready", os.getpid())
    if mode == "exit":
        sys.exit(0)
    if mode == "fail" and rank == "1":
        while not os.path.exists("go"):
            time.sleep(0.05)
        sys.exit(1)
    time.sleep(1000)
""")


def _start(tmp_path: Path, nproc: int, *script_args: str, grace: int = 2) -> subprocess.Popen:
    (tmp_path / "family.py").write_text(FAMILY)
    return subprocess.Popen(
        _cmd(f"--nproc_per_node={nproc}", f"--shutdown_timeout={grace}", "family.py", *script_args),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(tmp_path: Path, proc: subprocess.Popen, nproc: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all((tmp_path / "pids" / f"{r}.ready").exists() for r in range(nproc)):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"launcher exited ({proc.returncode}) before the workers were ready:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"workers not ready within {START_TIMEOUT_S} s")
        time.sleep(0.05)


def _job_pids(tmp_path: Path, launcher: int | None = None) -> dict[int, str]:
    """Every recorded pid, plus (while the launcher lives) all its descendants: pid -> what."""
    pids = {int(p.read_text()): p.name for p in (tmp_path / "pids").glob("*") if not p.name.endswith(".tmp")}
    if launcher is not None:
        for p in _reaper.descendants(_reaper.all_processes(), launcher):
            pids.setdefault(p.pid, "descendant of the launcher")
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _assert_gone(pids: dict[int, str], since: float) -> float:
    """Poll until no pid of `pids` is alive (zombies count as gone); the seconds it took."""
    deadline = since + GONE_WITHIN_S
    while True:
        alive = {pid: what for pid, what in pids.items() if _alive(pid)}
        if not alive:
            return time.monotonic() - since
        if time.monotonic() > deadline:
            left = [f"{pid} ({what}: {_cmdline(pid)})" for pid, what in alive.items()]
            pytest.fail(f"still alive {GONE_WITHIN_S} s after the job ended: {', '.join(left)}")
        time.sleep(0.05)


def _cleanup(proc: subprocess.Popen, tmp_path: Path) -> None:
    """After a failed assertion: end what this test started, by recorded pid only."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    if (tmp_path / "pids").exists():
        for pid in _job_pids(tmp_path):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_failed_worker_leaves_no_process_of_the_job(tmp_path):
    proc = _start(tmp_path, 2, "fail", "hidden")
    try:
        _wait_ready(tmp_path, proc, 2)
        pids = _job_pids(tmp_path, proc.pid)
        (tmp_path / "go").touch()
        since = time.monotonic()
        _, err = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 1, err
        assert "rank 1 (local rank 1" in err
        # metaoptrun returns only once they are gone: the poll must find nothing at once
        assert [p for p in pids if _alive(p)] == [], {p: _cmdline(p) for p in pids if _alive(p)}
        took = _assert_gone(pids, since)
        # the deaf child needs SIGKILL after --shutdown_timeout=2, so ~2 s; not 30 s (torch's fixed wait)
        assert took < 2 + 5, took
    finally:
        _cleanup(proc, tmp_path)


def test_a_successful_job_leaves_no_process_behind(tmp_path):
    proc = _start(tmp_path, 1, "exit", "hidden")
    try:
        _, err = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, err
        pids = _job_pids(tmp_path)
        assert len(pids) == 7  # worker (== ready), plain, deaf, own_group, own_session, hidden, daemon
        assert [p for p in pids if _alive(p)] == [], {p: _cmdline(p) for p in pids if _alive(p)}
    finally:
        _cleanup(proc, tmp_path)


RESTART = textwrap.dedent("""
    import os, subprocess, sys, time
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0":
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        with open(f"child.{os.environ['RANK']}.tmp", "w") as f:
            f.write(str(child.pid))
        os.replace(f"child.{os.environ['RANK']}.tmp", f"child.{os.environ['RANK']}")
        if os.environ["RANK"] == "1":
            # fail only once rank 0 has started its child too: failing earlier lets the
            # launcher end rank 0 before it wrote child.0 (a race seen under load in CI)
            deadline = time.monotonic() + 60
            while not os.path.exists("child.0") and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(1)
        sys.exit(0)
    # the restarted group starts only once the first attempt's processes are gone
    for rank in range(2):
        pid = int(open(f"child.{rank}").read())
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        print(f"child of rank {rank} of attempt 0: {state}")
""")


def test_a_restart_begins_without_the_failed_attempts_processes(tmp_path):
    (tmp_path / "restart.py").write_text(RESTART)
    res = subprocess.run(
        _cmd("--nproc_per_node=2", "--max-restarts=1", "restart.py"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    children = [int((tmp_path / f"child.{r}").read_text()) for r in range(2)]
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        log = (tmp_path / "log" / "workerlog.0").read_text()
        for rank in range(2):  # a zombie (Z) has exited; only its parent's reaping is pending
            assert re.search(rf"child of rank {rank} of attempt 0: (gone|Z)", log), log
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_ends_every_process_of_the_job(tmp_path, sig):
    proc = _start(tmp_path, 2, "sleep", "hidden")
    try:
        _wait_ready(tmp_path, proc, 2)
        pids = _job_pids(tmp_path, proc.pid)
        proc.send_signal(sig)
        since = time.monotonic()
        _, err = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 128 + sig, err
        assert [p for p in pids if _alive(p)] == [], {p: _cmdline(p) for p in pids if _alive(p)}
        assert _assert_gone(pids, since) < 2 + 5
    finally:
        _cleanup(proc, tmp_path)


def _cgroup_possible() -> bool:
    made = _reaper.JobCgroup("probe" + str(os.getpid()))
    _reaper.JobCgroup.remove_dir(made.path)
    return made.path is not None


def test_sigkill_of_the_launcher_ends_every_process_of_the_job(tmp_path):
    # "hidden" (left the worker's session *and* dropped METAOPT_JOB_ID) is found after the
    # launcher's death only through the job's cgroup; without one it survives (docs/launcher.md)
    args = ("sleep", "hidden") if _cgroup_possible() else ("sleep",)
    proc = _start(tmp_path, 2, *args)
    try:
        _wait_ready(tmp_path, proc, 2)
        pids = _job_pids(tmp_path, proc.pid)  # the guardian among them: it must end too
        assert any(_reaper.__file__ in _cmdline(p) for p in pids), "no guardian"
        proc.kill()
        since = time.monotonic()
        proc.wait(timeout=30)
        # the guardian SIGTERMs, waits --shutdown_timeout=2 for the deaf child, then SIGKILLs
        assert _assert_gone(pids, since) < 2 + 5
    finally:
        _cleanup(proc, tmp_path)


@pytest.mark.skipif(not _cgroup_possible(), reason="no cgroup can be made here (docs/launcher.md: the limit)")
def test_a_job_cgroup_holds_every_process_and_goes_with_the_job(tmp_path):
    proc = _start(tmp_path, 1, "sleep", "hidden")
    try:
        _wait_ready(tmp_path, proc, 1)
        pids = _job_pids(tmp_path)
        groups = {Path(f"/proc/{pid}/cgroup").read_text() for pid in pids}
        assert len(groups) == 1 and "metaopt-" in groups.pop()  # the daemon and "hidden" too
        worker = int((tmp_path / "pids" / "0.worker").read_text())
        env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        path = next(e for e in env if e.startswith(_reaper.CGROUP_ENV.encode())).split(b"=", 1)[1].decode()
        assert os.path.isdir(path)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=START_TIMEOUT_S)
        assert not os.path.exists(path)  # removed once empty
    finally:
        _cleanup(proc, tmp_path)


def test_a_sigterm_ignoring_worker_ends_soon_after_a_sigkilled_launcher(tmp_path):
    # --shutdown_timeout=30: the guardian still SIGKILLs after ORPHAN_GRACE_S, not 30 s
    proc = _start(tmp_path, 1, "sleep", "deaf_worker", grace=30)
    try:
        _wait_ready(tmp_path, proc, 1)
        pids = _job_pids(tmp_path, proc.pid)
        proc.kill()
        since = time.monotonic()
        proc.wait(timeout=30)
        took = _assert_gone(pids, since)
        assert _reaper.ORPHAN_GRACE_S - 0.5 < took < _reaper.ORPHAN_GRACE_S + 5, took
    finally:
        _cleanup(proc, tmp_path)


def test_end_processes_finds_by_environment_session_and_ancestry(tmp_path):
    before = [p.pid for p in _reaper.descendants(_reaper.all_processes(), os.getpid())]
    env = {**os.environ, _reaper.JOB_ID_ENV: "testjob"}
    deaf = {"preexec_fn": lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)}
    started = [
        subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True, **deaf),  # by environment
        subprocess.Popen(["sleep", "1000"], start_new_session=True),  # by session, below
        subprocess.Popen(["sleep", "1000"]),  # by ancestry only
    ]
    try:
        without_root = _reaper.JobFinder("testjob")
        without_root.sessions.add(started[1].pid)
        assert set(without_root.find()) == {started[0].pid, started[1].pid}
        finder = _reaper.JobFinder("testjob", root=os.getpid(), spare=before)  # not pytest's other children
        finder.sessions.add(started[1].pid)
        assert set(finder.find()) == {p.pid for p in started}
        t0 = time.monotonic()
        ended, left = _reaper.end_processes(finder, signal.SIGTERM, t0 + 0.5)
        took = time.monotonic() - t0
        assert (ended, left) == (3, [])
        assert 0.5 <= took < 3  # the deaf one waited out the deadline, then SIGKILL
        assert [p.wait(timeout=5) for p in started] == [-signal.SIGKILL, -signal.SIGTERM, -signal.SIGTERM]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_send_spares_a_reused_pid():
    child = subprocess.Popen(["sleep", "1000"])
    try:
        start = _reaper.read_stat(child.pid).start
        _reaper.send(child.pid, start + 1, signal.SIGKILL)  # "another process with this pid"
        time.sleep(0.1)
        assert child.poll() is None
        _reaper.send(child.pid, start, signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.skipif(not _cgroup_possible(), reason="no cgroup can be made here")
def test_the_finder_finds_by_cgroup_what_has_no_other_mark():
    cgroup = _reaper.JobCgroup("findercase").path
    bare = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec sleep 1000"],
        env={"PATH": os.environ["PATH"]},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while bare.pid not in _reaper.JobCgroup.pids(cgroup) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _reaper.JobFinder("findercase").find() == {}  # no env, no known session
        finder = _reaper.JobFinder("findercase", cgroup=cgroup)
        assert set(finder.find()) == {bare.pid}
        assert _reaper.end_processes(finder, signal.SIGTERM, time.monotonic() + 2) == (1, [])
        assert bare.wait(timeout=5) == -signal.SIGTERM
    finally:
        if bare.poll() is None:
            bare.kill()
            bare.wait()
        _reaper.JobCgroup.remove_dir(cgroup)
    assert not os.path.exists(cgroup)


def test_the_worker_reads_the_cgroup_variable_the_launcher_sets():
    from metaopt.launch import _worker

    assert _worker.CGROUP_ENV == _reaper.CGROUP_ENV


def test_the_guardian_ends_the_job_when_its_pipe_closes():
    job_id = "guardedjob"
    guardian = _reaper._start_guardian(job_id, 1.0)
    assert guardian is not None
    marked = subprocess.Popen(
        ["sleep", "1000"], env={**os.environ, _reaper.JOB_ID_ENV: job_id}, start_new_session=True
    )
    try:
        guardian.stdin.close()  # what the launcher's death does
        assert guardian.wait(timeout=10) == 0
        assert marked.wait(timeout=5) == -signal.SIGTERM
    finally:
        for p in (marked, guardian):
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
