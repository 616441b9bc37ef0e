"""The schedule picture: where each pipeline worker's step goes, F, B, W, waits and idle time.

    pic = metaopt.schedule_picture(exe, stage_program, out="schedule")  # after a step, on every worker
    print(pic.summary())                       # per worker: measured bubble; the simulator's ideal

Every worker calls it after a pipelined step (it gathers each worker's last-step profile, a
collective); each gets the same picture, and worker 0 writes ``<out>/<name>.png`` and
``<out>/<name>.html`` (a Gantt chart per worker: each action's bar, its waits on communication
hatched, the idle time between) plus ``<out>/<name>.json``, which
``python -m metaopt schedule FILE.json`` draws again. Beside the measured run it draws the
schedule simulator's timeline from the measured mean F, B (and W) per worker, with its bubble:
what the same work would take with free communication. ``python -m metaopt schedule --simulate
ZBH1 --stages 4 --micro-batches 8`` draws a simulated schedule alone.

The profile the runtime keeps of each step (``runtime.pipeline.StepProfile.intervals``) is a few
floats per action, always recorded; drawing needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from metaopt.runtime.schedules import V_CHUNKS, ZERO_BUBBLE, canonical, simulate

Bar = tuple[str, float, float, float]  # (action, start, end, waited), seconds from the step's start


@dataclass
class SchedulePicture:
    name: str
    schedule: str
    micro_batches: int
    workers: list[list[Bar]]  # measured: each worker's actions (empty for a simulated picture)
    step_s: list[float]  # each worker's step wall time
    ideal: list[list[Bar]] = field(default_factory=list)  # the simulator's timeline, same work
    ideal_bubble: float | None = None

    @property
    def bubble(self) -> list[float]:
        """Per worker, the part of the slowest worker's step it spent not computing (waits and idle)."""
        span = max(self.step_s, default=0.0)
        return [1 - sum(e - s - w for _, s, e, w in bars) / span if span else 0.0 for bars in self.workers]

    def summary(self) -> str:
        lines = [f"schedule picture {self.name!r}: {self.schedule}, {self.micro_batches} micro-batches"]
        for k, (bars, b) in enumerate(zip(self.workers, self.bubble, strict=True)):
            waits = sum(w for *_, w in bars)
            lines.append(
                f"  worker {k}: step {self.step_s[k] * 1e3:.1f} ms, bubble {b:.3f} "
                f"(waits on communication {waits * 1e3:.1f} ms)"
            )
        if self.ideal_bubble is not None:
            how = "with the measured per-action times" if self.workers else "(the costs given)"
            lines.append(f"  simulated {how}: bubble {self.ideal_bubble:.3f}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "workers": self.workers,
            "step_s": self.step_s,
            "ideal": self.ideal,
            "ideal_bubble": self.ideal_bubble,
        }

    @classmethod
    def from_json(cls, d: dict) -> SchedulePicture:
        bars = [[tuple(b) for b in w] for w in d["workers"]]
        ideal = [[tuple(b) for b in w] for w in d.get("ideal", [])]
        return cls(
            d["name"], d["schedule"], d["micro_batches"], bars, d["step_s"], ideal, d.get("ideal_bubble")
        )


def from_profiles(
    name: str, schedule: str, micro_batches: int, profiles: list[dict], chunks: int = 1
) -> SchedulePicture:
    """The picture of one step from every worker's profile (``{"intervals": [...], "step_s": s}``),
    with the simulator's timeline of the same schedule from the measured per-action means
    (`chunks` per worker: an action is one chunk's, the simulator's costs a worker's whole share)."""
    workers = [[tuple(b) for b in p["intervals"]] for p in profiles]
    pic = SchedulePicture(name, schedule, micro_batches, workers, [p["step_s"] for p in profiles])
    means = {k: [chunks * _mean_compute(bars, k) for bars in workers] for k in "FBW"}
    if all(f > 0 for f in means["F"]) and all(b > 0 for b in means["B"]):
        split = schedule in ZERO_BUBBLE
        w = [max(x, 1e-9) for x in means["W"]] if split else None  # a stage's W may be (nearly) empty
        b = [bi + (wi if split else 0.0) for bi, wi in zip(means["B"], w or means["W"], strict=True)]
        sim = simulate(
            schedule,
            num_stages=len(workers),
            micro_batches=micro_batches,
            chunks=chunks,
            f_cost=means["F"],
            b_cost=b,
            w_cost=w,
        )
        pic.ideal = [[(str(a), s, e, 0.0) for s, e, a in line] for line in sim.timeline]
        pic.ideal_bubble = sim.bubble_fraction
    return pic


def _mean_compute(bars: list[Bar], kind: str) -> float:
    times = [e - s - w for a, s, e, w in bars if a.startswith(kind)]
    return statistics.mean(times) if times else 0.0


def simulated(
    schedule: str, *, num_stages: int, micro_batches: int, chunks: int | None = None, **costs: Any
) -> SchedulePicture:
    """The picture of the simulator's run of `schedule` alone (`costs`: f_cost, b_cost, w_cost;
    `chunks` None: ZB-V's two per worker, else one)."""
    if chunks is None:
        chunks = V_CHUNKS if canonical(schedule) == "ZBV" else 1
    sim = simulate(schedule, num_stages=num_stages, micro_batches=micro_batches, chunks=chunks, **costs)
    ideal = [[(str(a), s, e, 0.0) for s, e, a in line] for line in sim.timeline]
    name = f"{schedule} p={num_stages} m={micro_batches} (simulated)"
    return SchedulePicture(name, schedule, micro_batches, [], [], ideal, sim.bubble_fraction)


def schedule_picture(
    executor: Any, program: Any, *, out: str | None = None, name: str | None = None
) -> SchedulePicture:
    """The picture of `executor`'s last step of pipeline stage program `program`, every worker's
    (a collective: every worker calls it); worker 0 writes PNG, HTML and JSON under `out`."""
    from metaopt.layout.groups import all_gather_json
    from metaopt.runtime.pipeline import last_step_profile

    prof = last_step_profile(executor, program)
    if prof is None:
        raise ValueError(f"program {program.name!r} has run no pipelined step on this executor yet")
    mine = {"intervals": prof.intervals, "step_s": prof.step_s}
    info = program.pipeline
    profiles = all_gather_json(mine, "the schedule picture's profiles") if info.num_stages > 1 else [mine]
    pic = from_profiles(name or program.name, info.schedule, info.micro_batches, profiles, info.chunks)
    if out is not None and info.stage == 0:
        write(pic, out)
    return pic


def write(pic: SchedulePicture, out: str) -> list[str]:
    """PNG, HTML and JSON of `pic` under folder `out`; their paths."""
    from metaopt.report import schedule_plot

    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "".join(c if c.isalnum() or c in "-_." else "_" for c in pic.name))
    with open(base + ".json", "w") as f:
        json.dump(pic.to_json(), f)
    return [
        schedule_plot.write_png(pic, base + ".png"),
        schedule_plot.write_html(pic, base + ".html"),
        base + ".json",
    ]
