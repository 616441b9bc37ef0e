"""The memory picture (metaopt.report): its plotted peak is the executor's and the estimate's, the
files are written, the CLI draws a saved program, and it degrades to predicted only, saying why."""

from __future__ import annotations

import functools
import re
import sys
import warnings

import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.cli import main
from metaopt.passes.memory_estimate import MemoryWhere, estimate_memory, human_bytes
from metaopt.report import plot
from metaopt.report.memory_picture import MemoryPicture, measure_timeline, memory_picture, random_feed
from metaopt.runtime.memory import MemoryTracker
from metaopt.runtime.plan import build_plan

BATCH = {"mlp": 8, "bert": 4}
CHECKPOINTS = {"mlp": ["fc1", "fc2"], "bert": ["bert.encoder.layer.*"]}


@functools.cache
def fleet_program(name: str, strategy: str) -> metaopt.Program:
    """A tiny reference program trained by fleet with Adam: strategy none or offload
    (recompute + offload), dropout 0.1 (as tests/passes/test_memory_estimate.py)."""
    _, _, program = exported(name, dropout=0.1)
    main = program.clone()
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    if strategy == "offload":
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS[name], "enable_offload": True}
    with warnings.catch_warnings():  # mlp's checkpoints save nothing: recompute says so
        warnings.simplefilter("ignore", UserWarning)
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), s).minimize(main.loss)
    return main


def feed_of(name: str, batch: int) -> dict:
    mod = programs.get(name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", batch, seed=1), strict=True))


def _plotted_peak(pic, label: str) -> float:
    """The highest point of the drawn line called `label`, in bytes."""
    fig = plot.draw(pic)
    ax = fig.axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label() == label)
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    scale = 1024 ** ("B", "KiB", "MiB", "GiB").index(unit)
    return max(y for y in line.get_ydata() if y == y) * scale


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_plotted_peak_is_memory_stats_and_the_estimate(name):
    """mlp and bert tiny trained with fleet recompute + offload (Adam)."""
    p = fleet_program(name, "offload")
    feed = feed_of(name, BATCH[name])
    pic = memory_picture(p, feed)
    exe = metaopt.Executor("cpu")  # a plain one: the picture's own run is not the reference
    exe.run(p, feed=feed, fetch_list=[p.loss])
    stats = exe.memory_stats()
    est = estimate_memory(p, dims={"batch": BATCH[name]}, workspace=False)
    assert pic.dims == {"batch": BATCH[name]} and pic.note == ""
    assert pic.measured_peak == (est.peak_op, stats["peak_bytes"])
    assert pic.predicted_peak == (est.peak_op, est.peak_bytes)
    assert stats["peak_bytes"] == est.peak_bytes == pic.measured_peak_bytes
    assert _plotted_peak(pic, "measured (executor)") == pytest.approx(stats["peak_bytes"], rel=1e-12)
    assert _plotted_peak(pic, "predicted (estimate_memory)") == pytest.approx(est.peak_bytes, rel=1e-12)
    assert pic.where.op == est.peak_op and pic.where.total_bytes == est.peak_bytes
    assert len(pic.measured) == len(pic.predicted) == len(p.ops)
    if name == "mlp":  # every mlp op's row describes its storage: equal at every op
        assert pic.measured == pic.predicted


def test_files_are_written_and_the_page_has_a_tooltip_per_op(tmp_path):
    p = fleet_program("bert", "offload")
    pic = memory_picture(p, feed_of("bert", 4), out=tmp_path)
    png, page, txt = (tmp_path / f"bert_memory.{ext}" for ext in ("png", "html", "txt"))
    assert pic.files == [str(png), str(page), str(txt)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    html = page.read_text()
    assert html.count("<svg") == 1 and html.count("<title>op ") == len(p.ops)
    op, peak = pic.measured_peak
    assert f"<title>op {op} ({p.ops[op].role})" in html
    assert "fill-opacity: 0" in html  # the hover columns take pointer events
    assert f"measured peak:  {human_bytes(peak)} ({peak:,} B) at op {op}" in txt.read_text()


def test_cli_draws_a_saved_program(tmp_path, capsys):
    p = fleet_program("mlp", "offload")
    path = tmp_path / "mlp_train.onnx"
    metaopt.save(p, path)  # the public form: a training program, backward and updates included
    out = tmp_path / "pictures"
    assert main(["memory", str(path), "--batch", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    loaded = metaopt.load(str(path))
    timeline, peak = measure_timeline(loaded, random_feed(loaded, {"batch": 8})[0], [loaded.loss_name])
    assert f"measured peak:  {human_bytes(peak)} ({peak:,} B)" in text
    assert f"predicted peak: {human_bytes(peak)} ({peak:,} B)" in text
    # issue 43: the host account beside the device's (offload's copies, the load transient)
    from metaopt.passes.memory_estimate import estimate_memory

    host = estimate_memory(loaded, dims={"batch": 8}).host
    assert host["load transient"] > 0  # the largest value read into host memory
    listed = ", ".join(f"{k} {human_bytes(b)}" for k, b in host.items())
    assert f"host memory beside the device (predicted): {human_bytes(sum(host.values()))}: {listed}" in text
    assert f"# wrote {out / 'mlp_memory.png'}" in text
    assert (out / "mlp_memory.png").stat().st_size > 0 and (out / "mlp_memory.html").stat().st_size > 0
    with pytest.raises(SystemExit, match=r"--dim 'seq' is not NAME=N"):
        main(["memory", str(path), "--dim", "seq", "--out", str(out)])


def test_predicted_only_says_why(tmp_path):
    p = fleet_program("mlp", "none")
    feed, why = random_feed(p, {})
    assert feed is None
    assert why == "input 'x' has unbound dims ['batch']: bind them (--dim NAME=N) or pass a feed"
    pic = memory_picture(p)  # no feed, no batch
    assert pic.measured is None and pic.note == why
    assert "measured: no run, predicted only (input 'x' has unbound dims" in pic.summary()
    off = memory_picture(p, batch=8, measure=False, out=tmp_path)
    assert off.measured is None and "measure=False" in off.note
    assert (tmp_path / "mlp_memory.png").stat().st_size > 0


def test_random_feed_binds_dims_and_makes_valid_indices():
    p = fleet_program("bert", "none")
    feed, why = random_feed(p, {"batch": 3})
    assert why == "" and set(feed) == set(p.inputs)
    assert all(t.shape[0] == 3 for t in feed.values())
    assert all(not t.dtype.is_floating_point and not t.any() for t in feed.values())  # ids are zeros


def test_timeline_recording_is_off_by_default_and_costs_no_generated_code():
    p = fleet_program("mlp", "none")
    plain, recording = metaopt.Executor("cpu"), metaopt.Executor("cpu", record_timeline=True)
    assert type(plain._tracker) is MemoryTracker  # the plain tracker: nothing recorded per op
    # The same generated code, except that a recording executor runs the updates op by op (one
    # timeline entry per op), not as one multi-tensor call
    per_op = build_plan(p, [p.loss.name], torch.device("cpu"), True, plain.runtime, multi=False).source
    assert recording.plan_source(p, [p.loss]) == per_op
    assert "multi-tensor call" in plain.plan_source(p, [p.loss]) and "multi-tensor call" not in per_op
    plain.run(p, feed=feed_of("mlp", 8), fetch_list=[p.loss])
    with pytest.raises(ValueError, match=r"record_timeline=True"):
        plain.memory_timeline()
    with pytest.raises(ValueError, match=r"record_timeline=True\) needs track_memory=True"):
        metaopt.Executor("cpu", track_memory=False, record_timeline=True)


def test_timeline_is_the_last_step_only():
    p = fleet_program("mlp", "none")
    exe = metaopt.Executor("cpu", record_timeline=True)
    for _ in range(3):
        exe.run(p, feed=feed_of("mlp", 8), fetch_list=[p.loss])
    assert len(exe.memory_timeline()) == len(p.ops)
    assert max(exe.memory_timeline()) == exe.memory_stats()["last_run_peak_bytes"]


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path):
    pic = memory_picture(fleet_program("mlp", "none"), batch=8, measure=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'metaopt\[plot\]'"):
        pic.write(tmp_path)


def test_feed_given_binds_the_batch():
    p = fleet_program("mlp", "none")
    feed = {"x": torch.randn(5, 16), "label": torch.zeros(5, dtype=torch.int64)}
    assert set(feed) == set(p.inputs)
    pic = memory_picture(p, feed)
    assert pic.dims == {"batch": 5} and pic.measured == pic.predicted


def _synthetic(n: int) -> MemoryPicture:
    """A picture of `n` made-up ops (no program): forward, then backward, then optimize."""
    op_roles = ["forward"] * (n // 2) + ["backward"] * (n - n // 2 - 1) + ["optimize"]
    predicted = [1000 + min(i, n - i) for i in range(n)]
    where = MemoryWhere(n // 2, "y = Relu(x)  # role=forward", predicted[n // 2], ())
    return MemoryPicture(
        name="synthetic", dims={"batch": 1}, device="cpu", roles=op_roles,
        labels=[f"v{i} = Relu(v{i - 1})  # role={r}" for i, r in enumerate(op_roles)],
        predicted=predicted, persistable_bytes=1000, where=where, measured=list(predicted),
    )  # fmt: skip


def test_role_runs_merge_consecutive_roles_into_groups():
    runs = plot.role_runs(["forward", "loss", "backward", "recompute", "recompute", "prefetch", "lr-sched"])
    assert runs == [
        (0, 2, "forward"), (2, 3, "backward"), (3, 5, "recompute"), (5, 6, "offload/prefetch"),
        (6, 7, "optimize"),
    ]  # fmt: skip


def test_a_large_program_gets_one_tooltip_per_few_ops():
    n = 2 * plot.MAX_TOOLTIPS + 10
    svg = plot.svg_with_tooltips(_synthetic(n))
    per = -(-n // plot.MAX_TOOLTIPS)  # ceil: 3 ops per tooltip
    assert svg.count("<title>ops ") == -(-n // per)
    assert f"<title>ops 0-{per - 1}, most at op {per - 1} (forward)" in svg


def test_every_role_has_a_colour():
    """A new role must be placed in a group of the picture, not fall into another's colour."""
    from metaopt.ir.roles import ROLES
    from metaopt.report.plot import GROUP_OF_ROLE

    assert set(ROLES) <= set(GROUP_OF_ROLE)


def _tiny_file_with_a_huge_step(path) -> None:
    """A few hundred bytes of ONNX whose one step peaks at 8 GiB: a Tile of an [8, 1024] input
    (load allocates nothing for it, so `load` and `show` accept the file)."""
    from onnx import TensorProto, helper

    reps = helper.make_tensor("reps", TensorProto.INT64, [2], [1, 1 << 18])
    graph = helper.make_graph(
        [
            helper.make_node("Tile", ["x", "reps"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ],
        "bomb",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 1024])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[reps],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path.write_bytes(model.SerializeToString())


def test_memory_refuses_to_run_a_step_predicted_over_the_limit(tmp_path, capsys):
    src = tmp_path / "bomb.onnx"
    _tiny_file_with_a_huge_step(src)
    assert src.stat().st_size < 400
    code = main(["memory", str(src), "--batch", "8", "--out", str(tmp_path / "pic")])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(
        r"RunTooLarge: .*predicted to peak at 8\.0 GiB .* over 0\.5 of the limit of 4\.0 GiB .*--max-bytes",
        err,
    ), err
    assert "MemoryError" not in err  # our refusal, not an out-of-memory crash (issue 47)
    assert not (tmp_path / "pic").exists()


def test_a_step_predicted_just_under_the_limit_is_refused_too(tmp_path):
    """A run's process holds more than the prediction counts (a OneHot file predicted at 3.4 GiB
    peaked at 4.5 GB, issue 47): the refusal keeps a margin, half the limit."""
    from metaopt.limits import RunTooLarge
    from metaopt.report import memory_picture

    src = tmp_path / "bomb.onnx"
    _tiny_file_with_a_huge_step(src)
    program = metaopt.load(src)
    with pytest.raises(RunTooLarge, match=r"predicted to peak at 8\.0 GiB"):
        memory_picture(program, batch=8, max_bytes=9 << 30)  # 8 GiB is under 9 GiB, over half of it


def test_memory_draws_the_prediction_of_such_a_step_without_running_it(tmp_path, capsys):
    src = tmp_path / "bomb.onnx"
    _tiny_file_with_a_huge_step(src)
    assert main(["memory", str(src), "--batch", "8", "--no-measure", "--out", str(tmp_path / "pic")]) == 0


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ModelLoadError: ") and "Traceback" not in err
    with pytest.raises(Exception, match="not a valid ONNX model"):
        main(["--debug", "show", str(bad)])
