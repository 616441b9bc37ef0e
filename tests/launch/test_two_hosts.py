"""Two hosts, made as network namespaces joined by a veth pair (10.231.7.1 and 10.231.7.2; not
localhost, where every address works), each running `metaoptrun --ips=... --nproc_per_node=1`
as a fleetrun user would. Before the launcher (and fleet.init) named gloo's interface, gloo
listened on the host name's address, the loopback, and both sides failed: "connectFullMesh
failed ... remote=[127.0.0.1]". Needs root (namespaces); skipped elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from metaopt.layout import groups

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
IPS = ("10.231.7.1", "10.231.7.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Two namespaces `(a, b)` joined by a veth pair, IPS[0] in a and IPS[1] in b; removed after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    hosts = (f"mo{tag}a", f"mo{tag}b")
    links = (f"mo{tag}a", f"mo{tag}b")  # interface names: at most 15 characters
    try:
        for h in hosts:
            _ip("netns", "add", h)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for h, link, ip in zip(hosts, links, IPS, strict=True):
            _ip("link", "set", link, "netns", h)
            _ip("-n", h, "addr", "add", f"{ip}/24", "dev", link)
            _ip("-n", h, "link", "set", "lo", "up")
            _ip("-n", h, "link", "set", link, "up")
        yield hosts, links
    finally:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h], capture_output=True, timeout=10)


def _launch_on(hosts, tmp_path, script: list[str]) -> list[str]:
    """`metaoptrun --ips=... --nproc_per_node=1 SCRIPT...` in each host at once; their outputs,
    each launcher having exited 0."""
    env = {
        **os.environ,
        "METAOPT_COMM_TIMEOUT": "30",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "training")]),
    }
    env.pop(groups.GLOO_IFNAME, None)
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", h, sys.executable, "-m", "metaopt.launch", f"--ips={','.join(IPS)}",
             "--nproc_per_node=1", f"--log_dir={tmp_path / h}", *script],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for h in hosts
    ]  # fmt: skip
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_fleetrun_style_launch_on_two_hosts_trains_across_them(two_hosts, tmp_path):
    hosts, links = two_hosts
    outs = _launch_on(hosts, tmp_path, [str(HERE / "two_hosts_train.py")])
    for rank, (out, link) in enumerate(zip(outs, links, strict=True)):
        # each host's worker listened on its veth, which the launcher named (in its table)
        assert f"rank {rank} sum 3.0 on {link}" in out, out[-3000:]
        assert re.search(rf"^GLOO_SOCKET_IFNAME\s+{link}$", out, re.M), out[-3000:]


def test_data_parallel_across_two_hosts_equals_one_process(two_hosts, tmp_path):
    """tests/training/dp_worker.py's plain mlp case (5 Adam steps, each host on half of each
    batch) across the veth, against one process on the full batches: the data-parallel bar,
    rtol 1e-5 / atol 4e-5 (halves averaged round differently from one batch)."""
    sys.path.insert(0, str(ROOT / "tests" / "training"))
    import dp_worker

    hosts, _ = two_hosts
    out = tmp_path / "results"
    out.mkdir()
    _launch_on(hosts, tmp_path, [str(ROOT / "tests" / "training" / "dp_worker.py"), str(out), "mlp:plain"])
    ranks = [torch.load(out / f"mlp:plain.rank{r}.pt", weights_only=True) for r in range(2)]
    ref = dp_worker.single_process("mlp")
    mean_loss = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean_loss), torch.tensor(ref["losses"]), rtol=1e-5, atol=4e-5)
    for k, want in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][k], want, rtol=1e-5, atol=4e-5, msg=k)
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k


# --slow (32 s): restarts are in the suite on one host (test_launcher.py); this is the two-host run
@pytest.mark.slow
def test_a_worker_crash_restarts_the_job_from_the_latest_checkpoint_and_it_ends_equal(two_hosts, tmp_path):
    """--max_restarts 1 on both hosts: host b's worker dies after step 3's checkpoint; both
    launchers restart their workers, which load the latest checkpoint (a folder both hosts
    see) and finish steps 4-5: the params equal one uninterrupted process (the data-parallel
    bar, rtol 1e-5 / atol 4e-5)."""
    sys.path.insert(0, str(ROOT / "tests" / "training"))
    import dp_worker

    hosts, _ = two_hosts
    ckpt, out = tmp_path / "ckpt", tmp_path / "params.pt"
    script = [str(HERE / "two_hosts_resume.py"), str(ckpt), str(out), "3"]
    outs = _launch_on(hosts, tmp_path, ["--max_restarts=1", *script])
    for rank, text in enumerate(outs):
        assert f"rank {rank} attempt 0 starts at step 0" in text, text[-3000:]
        assert f"rank {rank} attempt 1 starts at step 3" in text, text[-3000:]
    got = torch.load(out, weights_only=True)
    for k, want in dp_worker.single_process("mlp")["params"].items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=4e-5, msg=k)


def test_a_link_cut_mid_job_ends_both_launchers_and_leaves_no_process(two_hosts, tmp_path):
    """The veth goes down while the workers all-reduce every 0.1 s: each worker's collective
    fails within METAOPT_COMM_TIMEOUT (10 s here), and each launcher ends non-zero, with no
    process of the job left on either host."""
    hosts, links = two_hosts
    tag = f"cut-{uuid.uuid4().hex[:8]}"  # in the workers' command lines: what pgrep looks for
    env = {
        **os.environ,
        "METAOPT_COMM_TIMEOUT": "10",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.pop(groups.GLOO_IFNAME, None)
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", h, sys.executable, "-m", "metaopt.launch", f"--ips={','.join(IPS)}",
             "--nproc_per_node=1", f"--log_dir={tmp_path / h}", str(HERE / "two_hosts_train.py"),
             "100000", tag],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for h in hosts
    ]  # fmt: skip
    try:
        logs = [tmp_path / h / "workerlog.0" for h in hosts]
        deadline = time.monotonic() + 120
        while not all(p.exists() and " step 3" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job never ran"
            time.sleep(0.2)
        _ip("-n", hosts[1], "link", "set", links[1], "down")  # the cable pulled on host b
        t0 = time.monotonic()
        outs = [p.communicate(timeout=90)[0] for p in procs]
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode != 0, out[-3000:]
    print(f"both launchers ended {took:.1f} s after the cut")
    assert took < 60, f"the launchers took {took:.0f} s to end after the cut"
    left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the job left: {left}"


def test_the_interface_towards_the_master_is_chosen_unless_the_user_chose():
    environ: dict[str, str] = {}
    assert groups.choose_gloo_interface("127.0.0.1", environ) == "lo" == environ[groups.GLOO_IFNAME]
    mine = {groups.GLOO_IFNAME: "eth7"}
    assert groups.choose_gloo_interface("127.0.0.1", mine) == "eth7"  # the user's stays
    assert groups.interface_towards("::1") is None  # IPv6: gloo's own choice
