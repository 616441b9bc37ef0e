"""The schedule picture (report/schedule_picture.py): a Gantt chart of a pipelined step per
worker, measured and simulated, as PNG, HTML (a tooltip per bar) and JSON, and the CLI that draws
it again. The picture of a real run of 2 gloo workers: tests/training/test_zero_bubble.py."""

from __future__ import annotations

import json

import pytest

from metaopt.report.schedule_picture import SchedulePicture, from_profiles, simulated, write
from metaopt.runtime.schedules import schedule

pytest.importorskip("matplotlib")


def test_a_simulated_picture_draws_every_action_with_a_tooltip(tmp_path):
    pic = simulated("ZBH1", num_stages=2, micro_batches=4)
    assert pic.ideal_bubble == pytest.approx(1 / 13)  # (p-1)/(3m+p-1)
    assert [a for a, *_ in pic.ideal[1]] == [
        str(a) for a in schedule("ZBH1", num_stages=2, stage=1, micro_batches=4)
    ]
    png, page, data = write(pic, str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(page).read()
    assert text.count("<title>worker ") == 2 * 12  # 2 workers x (4 F, 4 B, 4 W)
    assert SchedulePicture.from_json(json.load(open(data))) == pic


def test_from_profiles_measures_each_workers_bubble_and_simulates_the_same_work():
    # worker 0: F0 F1 then B0 B1 with 1 ms waiting at B0's start; worker 1 idle until 1 ms
    w0 = [("F0", 0.0, 1e-3, 0.0), ("F1", 1e-3, 2e-3, 0.0), ("B0", 2e-3, 5e-3, 1e-3), ("B1", 5e-3, 7e-3, 0.0)]
    w1 = [("F0", 1e-3, 2e-3, 0.0), ("B0", 2e-3, 4e-3, 0.0), ("F1", 4e-3, 5e-3, 0.0), ("B1", 5e-3, 7e-3, 0.0)]
    pic = from_profiles(
        "toy", "1F1B", 2, [{"intervals": w0, "step_s": 7e-3}, {"intervals": w1, "step_s": 7e-3}]
    )
    assert pic.bubble == pytest.approx([1 - 6 / 7, 1 - 6 / 7])  # compute: 1+1+2+2 ms of 7
    # the simulator with the measured means (F 1 ms, B 2 ms on both): 1F1B's (p-1)/(m+p-1)
    assert pic.ideal_bubble == pytest.approx(1 / 3)
    assert [a for a, *_ in pic.ideal[0]] == ["F0", "F1", "B0", "B1"]
    assert "worker 0: step 7.0 ms, bubble 0.143 (waits on communication 1.0 ms)" in pic.summary()


def test_the_cli_draws_a_saved_picture_and_a_simulated_one(tmp_path, capsys):
    from metaopt.cli import main

    assert (
        main(
            [
                "schedule",
                "--simulate",
                "1F1B",
                "--stages",
                "2",
                "--micro-batches",
                "4",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bubble 0.200" in out and out.count("wrote ") == 3
    saved = next(tmp_path.glob("*.json"))
    assert main(["schedule", str(saved), "--out", str(tmp_path / "again")]) == 0
    assert main(["schedule"]) == 2
    assert "give a schedule picture's JSON file or --simulate" in capsys.readouterr().err
