"""Find and end every process of a metaoptrun job on this node, workers' children included.

torch starts each worker in its own session and, when it ends the workers, signals the
process group of each worker *still running*, then SIGKILLs the groups of workers still
running after the grace period. That misses the children of a worker that has already
exited (the one that failed), children that outlive SIGTERM once their worker is gone,
children that left the group (setsid, a daemon's double fork), and everything when the
launcher itself is SIGKILLed. So the job's processes are found here, through /proc (Linux),
by three marks a process cannot shed by accident:

* the environment: every worker gets METAOPT_JOB_ID=<uuid>, inherited by whatever it
  starts (a fork shares it; exec keeps it unless the caller passes a fresh env);
* the session: torch makes each worker a session leader (sid == its pid), and only setsid
  leaves a session;
* ancestry: the launcher is a child subreaper (PR_SET_CHILD_SUBREAPER), so the orphans of
  its workers are re-parented to it rather than to init and stay its descendants.

and, where the machine lets the launcher make one, a fourth that nothing but a privileged
move can shed: a cgroup of the job's own (``JobCgroup``), which every worker joins before
it runs the script, so whatever it starts, daemons with an emptied environment included,
is born in it.

The launcher ends processes by all four (``JobProcesses``). Its guardian, this file run as
a script (``python -I -S _reaper.py JOB_ID GRACE_S LAUNCHER_PID [CGROUP]``) in a session of
its own, reads worker pids from a pipe the launcher holds; when the pipe closes, which is
also what happens when the launcher is SIGKILLed, it ends what is left by environment,
session and cgroup, with at most ``ORPHAN_GRACE_S`` between SIGTERM and SIGKILL: the
launcher is gone, nobody waits for a clean exit, and saves are atomic.
Standard library only: the guardian starts in milliseconds and never imports torch.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Collection, Iterable
from typing import NamedTuple

JOB_ID_ENV = "METAOPT_JOB_ID"
CGROUP_ENV = "METAOPT_CGROUP"  # the job cgroup's directory; _worker.py joins it first
ORPHAN_GRACE_S = 3.0  # the guardian's SIGTERM -> SIGKILL wait once the launcher is gone
POLL_S = 0.05
KILL_ROUNDS = 40  # x POLL_S: how long SIGKILLed processes get to disappear (D state, teardown)
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
HAVE_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self")


class Proc(NamedTuple):
    pid: int
    ppid: int
    sid: int
    state: str  # "Z": exited, waiting to be reaped
    start: int  # clock ticks after boot: with pid, names one process (pids are reused)


def read_stat(pid: int) -> Proc | None:
    """`pid`'s /proc/PID/stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and ')': the fields start after the last ')'
    fields = data[data.rfind(b")") + 2 :].split()
    return Proc(pid, int(fields[1]), int(fields[3]), fields[0].decode(), int(fields[19]))


def all_processes() -> list[Proc]:
    """Every process this machine's /proc shows."""
    procs = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_stat(int(name))
            if proc is not None:
                procs.append(proc)
    return procs


def _has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def descendants(procs: list[Proc], root: int, spare: Collection[int] = ()) -> list[Proc]:
    """The processes of `procs` below `root`, leaving out the `spare` ones and theirs."""
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child.pid not in spare:
                found.append(child)
                stack.append(child.pid)
    return found


def _cgroup_candidates() -> list[str]:
    """The directories of this process's own cgroups that could hold a job's cgroup: the
    unified (v2) one first, then the v1 `pids` and `freezer` ones (they count every process
    and cost nothing)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for wanted in ("", "pids", "freezer"):
        path = next((p for _, ctl, p in own if wanted in ctl.split(",")), None)
        if path is None:
            continue
        for m in mounts:
            fstype, options = m[m.index("-") + 1], m[-1].split(",")
            ok = fstype == "cgroup2" if not wanted else fstype == "cgroup" and wanted in options
            root = m[3].rstrip("/")  # the part of the hierarchy the mount shows (a container's)
            if ok and (path + "/").startswith(root + "/"):
                found.append(os.path.join(m[4], path[len(root) :].lstrip("/")))
                break
    return found


class JobCgroup:
    """A cgroup of the job's own: `path` (a directory), or None where none could be made
    (no cgroup mount, not writable: an unprivileged user outside a delegated subtree)."""

    def __init__(self, job_id: str) -> None:
        self.path: str | None = None
        for parent in _cgroup_candidates():
            path = os.path.join(parent, f"metaopt-{job_id}")
            try:
                os.mkdir(path)
            except OSError:
                continue
            if os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
                self.path = path
                return
            self.remove_dir(path)

    @staticmethod
    def pids(path: str | None) -> set[int]:
        """The pids now in the cgroup at `path` (none when it is gone or None)."""
        if path is None:
            return set()
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return {int(line) for line in f if line.strip()}
        except OSError:
            return set()

    @staticmethod
    def remove_dir(path: str | None) -> None:
        """Remove the (empty) cgroup; one still holding a process (D state) is left."""
        if path is not None:
            try:
                os.rmdir(path)
            except OSError:
                pass


class JobFinder:
    """Which live processes belong to job `job_id`: by environment, worker session, the
    job's `cgroup` (a directory) and (with `root`) descent from `root` outside the `spare`
    subtrees."""

    def __init__(
        self, job_id: str, root: int | None = None, spare: Iterable[int] = (), cgroup: str | None = None
    ) -> None:
        self.entry = f"{JOB_ID_ENV}={job_id}".encode()
        self.sessions: set[int] = set()
        self.root = root
        self.spare = {*spare, os.getpid()}
        self.cgroup = cgroup

    def find(self) -> dict[int, int]:
        """pid -> start time of each live (not yet exited) process of the job."""
        procs = all_processes()
        contained = JobCgroup.pids(self.cgroup)
        found = [
            p
            for p in procs
            if p.pid not in self.spare
            and (p.sid in self.sessions or p.pid in contained or _has_env(p.pid, self.entry))
        ]
        if self.root is not None:
            found += descendants(procs, self.root, self.spare)
        return {p.pid: p.start for p in found if p.state != "Z"}


def send(pid: int, start: int, sig: int) -> None:
    """Send `sig` to `pid` if it is still the process that started at `start`."""
    try:
        fd = os.pidfd_open(pid)  # holds the process: the check below cannot race a reused pid
    except (AttributeError, OSError):
        fd = None
    try:
        proc = read_stat(pid)
        if proc is None or proc.start != start:
            return
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def end_processes(finder: JobFinder, sig: int, deadline: float, reap: bool = False) -> tuple[int, list[int]]:
    """Send `sig` once to every process of the job (those started meanwhile too), wait until
    `deadline` for them to exit, then SIGKILL the rest. ``(how many were found, pids still
    alive at the end)``; `reap`: collect the exit status of orphans re-parented to us.
    """
    signalled: set[tuple[int, int]] = set()
    while True:
        found = finder.find()
        if not found or time.monotonic() >= deadline:
            break
        for pid, start in found.items():
            if (pid, start) not in signalled:
                send(pid, start, sig)
                send(pid, start, signal.SIGCONT)  # a stopped process acts on nothing else
                signalled.add((pid, start))
        time.sleep(POLL_S)
        if reap:
            reap_orphans(finder.sessions | finder.spare)
    for _ in range(KILL_ROUNDS):  # more rounds: what forks while being killed is found next time
        if not found:
            break
        for pid, start in found.items():
            send(pid, start, signal.SIGKILL)
            signalled.add((pid, start))
        time.sleep(POLL_S)
        if reap:
            reap_orphans(finder.sessions | finder.spare)
        found = finder.find()
    return len(signalled), sorted(found)


def reap_orphans(managed: Collection[int]) -> None:
    """Collect the exit status of our exited children other than `managed` ones: orphans
    re-parented to this subreaper. Workers are `managed`: their Popen needs their exit codes."""
    me = os.getpid()
    for p in all_processes():
        if p.ppid == me and p.state == "Z" and p.pid not in managed:
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or stop); False where the OS cannot."""
    if not HAVE_PROC:
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children(pid: int) -> list[int]:
    return [p.pid for p in all_processes() if p.ppid == pid]


class JobProcesses:
    """The processes of one job on this node, from its first worker to its last grandchild.

    Use as a context manager around the agent's run: entering makes this process a
    subreaper, makes the job's cgroup and starts the guardian; ``env`` goes into every
    worker's environment,
    ``workers_started`` gets each worker group's pids, ``end`` ends the job's processes;
    leaving ends whatever is left and hands the rest to the guardian. Without /proc (not
    Linux) all of it does nothing, and torch's own ending of the worker groups is all there is.
    """

    def __init__(self, grace_s: float) -> None:
        self.job_id = uuid.uuid4().hex
        self.env = {JOB_ID_ENV: self.job_id}
        self._grace_s = grace_s
        self._finder: JobFinder | None = None
        self._guardian: subprocess.Popen | None = None
        self._subreaper = False
        self.cgroup: str | None = None

    def __enter__(self) -> JobProcesses:
        if HAVE_PROC:
            me = os.getpid()
            self._subreaper = set_subreaper(True)
            self.cgroup = JobCgroup(self.job_id).path
            if self.cgroup is not None:
                self.env[CGROUP_ENV] = self.cgroup
            self._guardian = _start_guardian(self.job_id, self._grace_s, self.cgroup)
            spare = _children(me)  # the caller's own children (guardian included) are not the job's
            root = me if self._subreaper else None
            self._finder = JobFinder(self.job_id, root=root, spare=spare, cgroup=self.cgroup)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.end(signal.SIGTERM, self._grace_s)
        finally:
            self._stop_guardian()
            JobCgroup.remove_dir(self.cgroup)
            if self._subreaper:
                set_subreaper(False)

    def workers_started(self, pids: Iterable[int]) -> None:
        """Record a worker group's pids: each is its session's id."""
        pids = list(pids)
        if self._finder is not None:
            self._finder.sessions.update(pids)
        if self._guardian is not None and self._guardian.stdin is not None:
            try:
                self._guardian.stdin.write("".join(f"{p}\n" for p in pids).encode())
                self._guardian.stdin.flush()
            except OSError:  # the guardian died: the launcher still ends the job itself
                pass

    def end(self, sig: int, timeout_s: float) -> bool:
        """End every process of the job: `sig`, up to `timeout_s` to exit, then SIGKILL.
        False where it cannot (no /proc): the caller must end the workers itself."""
        if self._finder is None:
            return False
        _, left = end_processes(self._finder, sig, time.monotonic() + timeout_s, reap=True)
        if left:  # SIGKILLed and still there: uninterruptible sleep (a hung driver or NFS)
            print(f"metaoptrun: processes {left} of the job did not exit after SIGKILL", file=sys.stderr)
        return True

    def _stop_guardian(self) -> None:
        guardian = self._guardian
        if guardian is None:
            return
        try:
            if guardian.stdin is not None:
                guardian.stdin.close()  # EOF: it checks once more that nothing is left, then exits
            guardian.wait(self._grace_s + KILL_ROUNDS * POLL_S + 5)
        except (OSError, subprocess.TimeoutExpired):
            pass  # it ends itself by its own deadline


def _start_guardian(job_id: str, grace_s: float, cgroup: str | None = None) -> subprocess.Popen | None:
    cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__), job_id, str(grace_s), str(os.getpid())]
    cmd += [cgroup] if cgroup else []
    try:
        # its own session: a Ctrl-C or a kill of the launcher's process group must not end it
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        msg = f"no guardian ({e}): if the launcher is killed, workers' children may stay"
        print(f"metaoptrun: warning: {msg}", file=sys.stderr)
        return None


def _read_sessions(finder: JobFinder, launcher: int) -> None:
    """Add worker pids from stdin to `finder` until EOF or the launcher is gone."""
    fd = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            if os.getppid() != launcher:  # re-parented: the launcher died, its pipe leaked somewhere
                return
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        *lines, buf = (buf + chunk).split(b"\n")
        finder.sessions.update(int(line) for line in lines if line.strip())


def guardian_main(argv: list[str]) -> int:
    """The guardian: wait for the launcher's pipe to close, then end what is left of the job."""
    job_id, grace_s, launcher = argv[0], float(argv[1]), int(argv[2])
    cgroup = argv[3] if len(argv) > 3 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle
    finder = JobFinder(job_id, cgroup=cgroup)
    _read_sessions(finder, launcher)
    grace_s = min(grace_s, ORPHAN_GRACE_S)
    ended, left = end_processes(finder, signal.SIGTERM, time.monotonic() + grace_s)
    JobCgroup.remove_dir(cgroup)
    if ended:
        msg = f"ended {ended} process(es) left by the job of launcher pid {launcher}"
        print(f"metaoptrun: {msg}", file=sys.stderr)
    if left:
        print(f"metaoptrun: processes {left} of the job did not exit after SIGKILL", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(guardian_main(sys.argv[1:]))
