"""One worker running a layout fleet.plan picked (started by tests/planner/test_search.py with
RANK/WORLD_SIZE/MASTER_*): ``python plan_worker.py OUT GLOBAL_BATCH LAYOUT_JSON``.

HF GPT-2 from the zoo without dropout, exported as the planner saw it; fleet.init and minimize
(Adam, as the planner's default) with the layout's strategy; two steps, each data-side worker fed
its share of the global batch (a pipeline's workers the share whole); writes this worker's
measured peaks (the executor's count of live bytes: the first step's and the second, steady
one's) and its own prediction to ``OUT/rank<r>.json``, with the links' latency and bandwidth as
`metaopt.planner.calibrate.measure_links` finds them.
"""

from __future__ import annotations

import json
import sys

import export_cache
import sp_worker

import metaopt
from metaopt import fleet
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.planner.search import Layout
from metaopt.report.pipeline_memory import estimate_pipeline_memory


def main() -> None:
    out, global_batch, layout = sys.argv[1], int(sys.argv[2]), Layout(**json.loads(sys.argv[3]))
    strategy = layout.strategy()
    fleet.init(is_collective=True, strategy=strategy)
    module, inputs, kwargs = sp_worker.build("hf-gpt2", 0.0)
    program = export_cache.export(module, inputs, **kwargs)
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), strategy).minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    side = sp_worker.data_side_rank(hcg)
    share = global_batch // layout.data
    full = sp_worker.batch("hf-gpt2", 0)
    whole = {k: v.repeat(-(-global_batch // v.shape[0]), 1)[:global_batch] for k, v in full.items()}
    feed = {k: v[side * share : (side + 1) * share].clone() for k, v in whole.items()}
    exe = metaopt.Executor("cpu")
    last = layout.pipe == 1 or hcg.get_stage_id() == layout.pipe - 1
    fetch = [program.loss] if last else []
    # the first step makes what the prediction holds all step from the start (a pipeline's
    # optimizer state appears at its first update): the second is the steady step predicted
    exe.run(program, feed=feed, fetch_list=fetch)
    first = exe.memory_stats()["last_run_peak_bytes"]
    exe.run(program, feed=feed, fetch_list=fetch)
    if layout.pipe > 1:
        predicted = estimate_pipeline_memory(program, batch=share).peak_bytes
    else:
        predicted = estimate_memory(program, dims={"batch": share}, workspace=False).peak_bytes
    rank = fleet.worker_index()
    from metaopt.planner.calibrate import measure_links

    latency, bandwidth = measure_links(sizes=(1 << 10, 1 << 20), reps=2)  # the planner's link rates
    result = {
        "measured": exe.memory_stats()["last_run_peak_bytes"],
        "first": first,
        "predicted": predicted,
        "rank": rank,
        "link": [latency, bandwidth],
    }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
