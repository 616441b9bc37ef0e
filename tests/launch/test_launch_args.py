"""metaoptrun's flag rules, the Fleet env it derives and its reports, without starting processes.

The machine is faked: `device_count` and the environment are parameters of plan_launch.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from metaopt.fleet.env import read_env
from metaopt.launch.agent import fleet_env, free_ports
from metaopt.launch.args import LaunchError, parse_args, plan_launch, resolve_gpus, visible_gpus
from metaopt.launch.report import describe_exit, failure_summary, format_envs, launcher_exit_code


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    return "train.py"


def plan(argv, environ=None, device_count=0, is_local=lambda ip: False):
    return plan_launch(parse_args(argv), environ or {}, device_count, is_local)


# --- spellings -------------------------------------------------------------------------------


def test_fleet_and_torchrun_spellings_mean_the_same(script):
    fleet = plan(["--nproc_per_node=3", "--log_dir=out", "--max_restarts=2", script, "--lr", "0.1"])
    torch = plan(["--nproc-per-node", "3", "--log-dir", "out", "--max-restarts", "2", script, "--lr", "0.1"])
    assert fleet == torch
    assert (fleet.nproc_per_node, fleet.log_dir, fleet.max_restarts) == (3, "out", 2)
    assert fleet.script_args == ("--lr", "0.1")


def test_defaults_one_cpu_worker_on_a_free_port(script):
    p = plan([script])
    assert (p.nproc_per_node, p.nnodes, p.node_rank, p.gpus) == (1, 1, 0, None)
    assert (p.master_addr, p.master_port, p.node_ip, p.log_dir) == ("127.0.0.1", None, "127.0.0.1", "log")


def test_script_flags_after_the_script_belong_to_the_script(script):
    p = plan(["--nproc_per_node=2", script, "--nproc_per_node=5", "--gpus", "x"])
    assert p.nproc_per_node == 2
    assert p.script_args == ("--nproc_per_node=5", "--gpus", "x")


def test_a_flag_prefix_is_not_taken_for_the_flag(script, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--nproc", "2", script])
    assert e.value.code == 2
    assert "unrecognized arguments: --nproc" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc_per_node=0"], "--nproc_per_node='0': must be >= 1"),
        (["--nproc_per_node=two"], "--nproc_per_node='two': expected an integer"),
        (["--max-restarts=-1"], "--max_restarts='-1': must be >= 0"),
        (["--master_port=70000"], "--master_port='70000': must be in 1..65535"),
        (["--nnodes=1:4"], "--nnodes=1:4: elastic node ranges (MIN:MAX) are not supported"),
        (["--nnodes=2"], "--nnodes=2 needs --node_rank"),
        (["--nnodes=2", "--node_rank=2"], "--node_rank='2': must be in 0..1"),
        (["--ips=10.0.0.1,10.0.0.2", "--nnodes=3"], "--nnodes=3 but --ips=10.0.0.1,10.0.0.2 lists 2 node(s)"),
        (["--ips=10.0.0.1,,10.0.0.2"], "--ips='10.0.0.1,,10.0.0.2': expected a comma list"),
        (["--ips=10.0.0.1,10.0.0.2"], "cannot tell which node this is (none of them is"),
        (
            ["--ips=10.0.0.1,10.0.0.2", "--node_rank=1", "--master_addr=10.0.0.9"],
            "the first ip is the master",
        ),
        (["--standalone", "--nnodes=2", "--node_rank=0"], "--standalone is one node"),
        (["--shutdown-timeout=-5"], "--shutdown_timeout='-5': must be >= 0"),
    ],
)
def test_bad_flags_name_the_flag(script, argv, message):
    with pytest.raises(LaunchError) as e:
        plan([*argv, script])
    assert message in str(e.value)


def test_missing_script_and_bad_log_dir(script, tmp_path):
    with pytest.raises(LaunchError, match="training script 'nope.py' not found"):
        plan(["nope.py"])
    assert plan(["-m", "some.module"]).module  # a module is not a file: not checked here
    (tmp_path / "afile").write_text("")
    with pytest.raises(LaunchError, match="--log_dir=afile: exists and is not a directory"):
        plan(["--log_dir=afile", script])


def test_shutdown_timeout_from_torchs_env_var(script):
    assert plan([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 7
    assert (
        plan(["--shutdown_timeout=3", script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 3
    )
    with pytest.raises(LaunchError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='x'"):
        plan([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "x"})


# --- nodes ------------------------------------------------------------------------------------


def test_ips_give_nodes_master_and_this_nodes_rank(script):
    p = plan(["--ips=10.0.0.1,10.0.0.2", script], is_local=lambda ip: ip == "10.0.0.2")
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port, p.node_ip) == (
        2,
        1,
        "10.0.0.1",
        29500,
        "10.0.0.2",
    )
    p = plan(["--ips=10.0.0.1,10.0.0.2", "--node-rank=0", "--master-port=6170", script])
    assert (p.node_rank, p.master_port, p.node_ip) == (0, 6170, "10.0.0.1")


def test_torchrun_multi_node_without_ips(script):
    p = plan(["--nnodes=2", "--node-rank=1", "--master-addr=10.1.1.1", script])
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port, p.node_ip) == (2, 1, "10.1.1.1", 29500, None)


def test_ambiguous_ips_on_one_machine_need_node_rank(script):
    with pytest.raises(LaunchError, match="2 of them are an address of this machine"):
        plan(["--ips=127.0.0.1,127.0.0.2", script], is_local=lambda ip: True)


def test_an_ips_entry_or_master_addr_that_does_not_resolve_is_named(script):
    """Issue 47: `--ips=no-such-host.invalid` hung the rendezvous with "gai error" warnings. Names
    under .invalid never resolve (RFC 6761); the real resolver answers at once."""
    with pytest.raises(LaunchError, match=r"--ips: 'no-such-host\.invalid' does not resolve to an address"):
        plan(["--ips=10.0.0.1,no-such-host.invalid", "--node_rank=0", script])
    with pytest.raises(LaunchError, match=r"--ips: 'no-such-host\.invalid' does not resolve"):
        plan(["--ips=no-such-host.invalid", script])
    with pytest.raises(LaunchError, match=r"--master_addr: 'nowhere\.invalid' does not resolve"):
        plan(["--nnodes=2", "--node-rank=1", "--master-addr=nowhere.invalid", script])


def test_the_restart_backoff_doubles_to_a_minute_even_after_very_many_restarts():
    from metaopt.launch.args import restart_backoff

    assert [restart_backoff(k, {}) for k in (1, 2, 3, 7, 1025, 10**30)] == [1, 2, 4, 60, 60, 60]
    assert restart_backoff(3, {"METAOPT_RESTART_BACKOFF": "0"}) == 0
    with pytest.raises(ValueError, match="must be a finite number of seconds"):
        restart_backoff(1, {"METAOPT_RESTART_BACKOFF": "inf"})


def test_the_launcher_exits_at_once_on_an_unresolvable_ips_entry(script):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "metaopt.launch", "--ips=no-such-host.invalid", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode != 0
    assert "'no-such-host.invalid' does not resolve" in done.stderr


# --- GPUs -------------------------------------------------------------------------------------


def test_gpus_resolve_against_cuda_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_gpus(env, 4) == ("4", "5", "6", "7")
    assert resolve_gpus("--gpus", "5,7", env, 4) == ("5", "7")
    with pytest.raises(LaunchError, match=r"--gpus=1: GPU 1 is not in CUDA_VISIBLE_DEVICES=4,5,6,7"):
        resolve_gpus("--gpus", "1", env, 4)
    with pytest.raises(LaunchError, match="GPU 7 is in CUDA_VISIBLE_DEVICES=4,5,6,7 but torch sees only 2"):
        resolve_gpus("--gpus", "7", env, 2)
    assert resolve_gpus("--gpus", "0,1", {}, 2) == ("0", "1")
    with pytest.raises(LaunchError, match="--gpus=2: there is no GPU 2; torch sees 2"):
        resolve_gpus("--gpus", "2", {}, 2)
    with pytest.raises(LaunchError, match="lists an entry twice"):
        resolve_gpus("--gpus", "0,0", {}, 2)


def test_gpus_without_cuda_is_an_error(script):
    with pytest.raises(LaunchError, match=r"--gpus=0,1: no CUDA device is visible"):
        plan(["--gpus=0,1", script], {"CUDA_VISIBLE_DEVICES": "0,1"}, device_count=0)


def test_gpus_set_workers_and_devices(script):
    p = plan(["--gpus=6,4", script], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, device_count=4)
    assert (p.nproc_per_node, p.gpus) == (2, ("6", "4"))
    p = plan(["--devices=1", script], {}, device_count=2)  # Paddle 2.x spelling
    assert (p.nproc_per_node, p.gpus) == (1, ("1",))
    with pytest.raises(LaunchError, match="--nproc_per_node=3 but --gpus=0,1 names 2 GPU"):
        plan(["--gpus=0,1", "--nproc_per_node=3", script], {}, device_count=2)
    with pytest.raises(LaunchError, match="--gpus=0 and --devices=1 disagree"):
        plan(["--gpus=0", "--devices=1", script], {}, device_count=2)


def test_with_gpus_and_no_flag_every_visible_gpu_gets_a_worker(script):
    p = plan([script], {"CUDA_VISIBLE_DEVICES": "2,3"}, device_count=2)
    assert (p.nproc_per_node, p.gpus) == (2, ("2", "3"))
    p = plan(["--nproc_per_node=1", script], {"CUDA_VISIBLE_DEVICES": "2,3"}, device_count=2)
    assert (p.nproc_per_node, p.gpus) == (1, ("2",))
    with pytest.raises(LaunchError, match="--nproc_per_node=3 but only 2 CUDA device"):
        plan(["--nproc_per_node=3", script], {}, device_count=2)


# --- the env workers get ------------------------------------------------------------------------


def test_fleet_env_agrees_with_torchs_and_fleet_init_reads_it():
    eps = ["10.0.0.1:6000", "10.0.0.1:6001", "10.0.0.2:6000", "10.0.0.2:6001"]
    torch_env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    env = {**torch_env, **fleet_env(torch_env, eps, ("5", "7"))}
    assert env["PADDLE_TRAINER_ID"] == "3" and env["PADDLE_TRAINERS_NUM"] == "4"
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:6001"
    assert (env["CUDA_VISIBLE_DEVICES"], env["FLAGS_selected_gpus"]) == ("5,7", "1")
    we = read_env(env)
    assert (we.rank, we.world_size, we.local_rank, we.endpoints) == (3, 4, 1, tuple(eps))
    assert "FLAGS_selected_gpus" not in fleet_env(torch_env, eps, None)
    with pytest.raises(RuntimeError, match="3 endpoints for a world of 4"):
        fleet_env(torch_env, eps[:3], None)


def test_free_ports_are_distinct():
    ports = free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


# --- reports ------------------------------------------------------------------------------------


def test_distributed_envs_table():
    text = format_envs({"RANK": "0", "PADDLE_TRAINER_ID": "0", "UNRELATED": "x", "MASTER_PORT": "1234"})
    lines = text.splitlines()
    assert lines[0].strip("-").strip() == "Distributed Envs" and set(lines[-1]) == {"-"}
    assert lines[1].split() == ["PADDLE_TRAINER_ID", "0"]
    assert ["MASTER_PORT", "1234"] in [line.split() for line in lines]
    assert "UNRELATED" not in text


def test_exit_descriptions_and_codes():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-int(signal.SIGKILL)) == "signal SIGKILL"
    assert launcher_exit_code(3) == 3
    assert launcher_exit_code(-int(signal.SIGSEGV)) == 128 + signal.SIGSEGV


def test_failure_summary_names_the_first_failure_and_shows_its_log(tmp_path):
    (tmp_path / "workerlog.2").write_text("".join(f"line {i}\n" for i in range(30)) + "ValueError: bad lr\n")

    def failure(local_rank, exitcode):
        return SimpleNamespace(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode)

    failures = {
        2: failure(2, -int(signal.SIGSEGV)),
        3: failure(3, 4),
        0: failure(0, -int(signal.SIGTERM)),
        1: failure(1, -int(signal.SIGTERM)),
    }
    text, code = failure_summary(failures, str(tmp_path), "the job failed")
    assert code == 128 + signal.SIGSEGV
    assert "rank 2 (local rank 2, pid 102) failed with signal SIGSEGV" in text
    assert "rank 3 also failed with exit code 4" in text
    assert "ended the other workers (rank 0, 1)" in text
    assert "ValueError: bad lr" in text and "line 11" in text and "line 10\n" not in text  # last 20 lines


def test_a_worker_count_past_the_node_limit_is_refused_naming_the_knob(script):
    """--nproc_per_node=10000 died with a raw E2BIG; 1000 started 1000 workers (7 GB in 15 s)."""
    too_many = r"--nproc_per_node=10000 is more than \d+ workers .*METAOPT_MAX_NPROC_PER_NODE"
    with pytest.raises(LaunchError, match=too_many):
        plan(["--nproc_per_node=10000", script])
    assert plan(["--nproc_per_node=12", script], {"METAOPT_MAX_NPROC_PER_NODE": "16"}).nproc_per_node == 12
    with pytest.raises(LaunchError, match="more than 4 workers"):
        plan(["--nproc_per_node=5", script], {"METAOPT_MAX_NPROC_PER_NODE": "4"})


def test_a_log_dir_under_a_file_is_refused(script, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(LaunchError, match=r"--log_dir=afile/logs/deeper: .*afile is not a directory"):
        plan(["--log_dir=afile/logs/deeper", script])
