"""fleet.DistributedStrategy: Fleet's fields and defaults, strict checking, table, JSON."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest

import metaopt
from metaopt import fleet
from metaopt.fleet.strategy import (
    ALL_CONFIGS,
    FIELDS,
    NO_EFFECT,
    REFUSED_CONFIGS,
    TABLES,
    UNIMPLEMENTED,
    UNSUPPORTED_FEATURES,
    unimplemented,
)
from metaopt.ir import Var

# Fleet's defaults (paddle/fluid/framework/distributed_strategy.proto), written out by hand
# so a changed default in the tables fails here; keys marked "ours" are metaopt's extras.
FLEET_DEFAULTS = {
    "amp": False,
    "recompute": False,
    "pipeline": False,
    "gradient_merge": False,
    "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32,
    "nccl_comm_num": 1,
    "sync_nccl_allreduce": True,
    "find_unused_parameters": False,
    "fuse_linear_cross_entropy": True,  # ours
    "optimizer_in_backward": False,  # ours
    "without_graph_optimization": True,
    "cuda_graph": False,  # ours (refused when True: not implemented yet)
    "sharding": False,
    "lamb": False,
    "lars": False,
    "dgc": False,
    "localsgd": False,
    "adaptive_localsgd": False,
    "a_sync": False,  # Fleet: True (parameter-server only); see the strategy module docstring
    "heter_ccl_mode": False,
    "asp": False,
    "qat": False,
    "elastic": False,
    "auto": False,
    "semi_auto": False,
    "use_hierarchical_allreduce": False,
    "fuse_grad_merge": False,
    "fp16_allreduce": False,
    "sync_batch_norm": False,
    "tensor_parallel": False,
    "amp_configs": {
        "init_loss_scaling": 32768.0,
        "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0,
        "decr_ratio": 0.8,
        "use_dynamic_loss_scaling": True,
        "custom_white_list": [],
        "custom_black_list": [],
        "custom_black_varnames": [],
        "use_pure_fp16": False,
        "use_fp16_guard": True,
        "dtype": "float16",
    },
    "recompute_configs": {
        "checkpoints": [],
        "enable_offload": False,
        "enable_partition": False,  # ours (Paddle's recompute_partition, a hybrid recompute ctx key)
        "checkpoint_shape": [],
        "policy": "full",  # ours
        "keep_op_types": [],  # ours
        "memory_budget": None,  # ours
        "budget_batch_size": 8,  # ours
        "offload_checkpoints": None,  # ours
        "recompute_head": True,  # ours (False: hold the ops before the first checkpoint)
        "seed_random_ops": True,  # ours
    },
    "pipeline_configs": {
        "micro_batch_size": None,  # Fleet: 1; None takes the fed batch / accumulate_steps
        "accumulate_steps": 1,
        "schedule_mode": "1F1B",
        "p2p_cache_shape": True,
        "cuts": [],  # ours
        "num_stages": None,  # ours
        "dp_degree": 1,  # ours
        "shared": [],  # ours
        "chunks": 1,  # ours: virtual stages per worker (interleaved)
    },
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    # Fleet's TensorParallelConfig (column / row / vocab / sequence_parallel: ours)
    "tensor_parallel_configs": {
        "tensor_parallel_degree": 1,
        "tensor_init_seed": -1,
        "column": [],
        "row": [],
        "vocab": [],
        "sequence_parallel": False,
        "one_process_dropout": False,
    },
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    # Fleet's LambConfig and LarsConfig
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []},
    "lars_configs": {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "epsilon": 0.0,
        "exclude_from_weight_decay": [],
    },
    # Fleet's ShardingConfig (the keys a static-graph sharding script sets)
    "sharding_configs": {
        "sharding_segment_strategy": "segment_broadcast_MB",
        "segment_broadcast_MB": 32.0,
        "sharding_degree": 8,
        "stage": 1,
        "optimize_offload": False,
        "hybrid_dp": False,
        "gradient_merge_acc_step": 1,
        "optimize_cast": False,
        "mp_degree": 1,
        "dp_degree": 1,
        "pp_degree": 1,
    },
    # Fleet's HybridConfig: dp_degree -1 = inferred from the world size
    # + Paddle 3's expert parallel (moe_sharding_degree: metaopt infers it, -1, where Paddle's is 1)
    "hybrid_configs": {
        "dp_degree": -1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": 1,
        "ep_degree": 1,
        "order": ["dp", "pp", "sharding", "sep", "mp"],  # Paddle's default, outermost first
        "sep_degree": 1,  # Paddle's segment parallel; cp_degree: context parallel (ring attention)
        "cp_degree": 1,
        "moe_sharding_degree": -1,
    },
    "moe_configs": {"capacity_factor": None},  # metaopt's: passes/expert_capacity.py
    # Fleet 2.x's other fields (distributed_strategy.proto): accepted, refused at minimize when set
    "fuse_grad_size_in_num": 8,
    "last_comm_group_size_MB": 1.0,
    "calc_comm_same_stream": False,
    "hierarchical_allreduce_inter_nranks": 1,
    "cudnn_exhaustive_search": False,
    "conv_workspace_size_limit": 512,
    "cudnn_batchnorm_spatial_persistent": False,
    "split_data": True,
    "sparse_table_configs": [],
    "auto_search": False,
    "is_fl_ps_mode": False,
    "is_with_coordinator": False,
    "adam_d2sum": False,
    "gradient_scale_configs": {"scale_strategy": "avg", "scale_gradient": False},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": []},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "a_sync_configs": {
        "k_steps": -1,
        "max_merge_var_num": 1,
        "send_queue_size": 16,
        "independent_recv_thread": False,
        "min_send_grad_num_before_recv": 1,
        "thread_pool_size": 1,
        "send_wait_times": 1,
        "runtime_split_send_recv": False,
        "launch_barrier": True,
        "heter_worker_device_guard": "cpu",
        "lr_decay_steps": 10,
        "use_ps_gpu": 0,
        "use_gpu_graph": 0,
    },
    "qat_configs": {
        "channel_wise_abs_max": True,
        "weight_bits": 8,
        "activation_bits": 8,
        "not_quant_pattern": [],
        "algo": "",
    },
    "trainer_desc_configs": {
        "dump_fields_path": "",
        "dump_fields": [],
        "dump_param": [],
        "stat_var_names": [],
        "trainer": "",
        "device_worker": "",
        "local_sparse": [],
        "remote_sparse": [],
    },
    "fs_client_param": {"uri": "", "user": "", "passwd": "", "hadoop_bin": ""},
    "build_strategy": {
        "enable_sequential_execution": False,
        "fuse_elewise_add_act_ops": False,
        "fuse_bn_act_ops": False,
        "fuse_relu_depthwise_conv": False,
        "fuse_broadcast_ops": False,
        "fuse_all_optimizer_ops": False,
        "enable_inplace": False,
        "enable_backward_optimizer_op_deps": True,
        "cache_runtime_context": False,
        "fuse_bn_add_act_ops": True,
        "enable_auto_fusion": False,
        "enable_addto": False,
        "fix_op_run_order": False,
        "allow_cuda_graph_capture": False,
        "fuse_gemm_epilogue": False,
        "reduce_strategy": 0,
        "debug_graphviz_path": "",
    },
    "execution_strategy": {
        "num_threads": 1,
        "num_iteration_per_drop_scope": 10,
        "num_iteration_per_run": 1,
        "use_thread_barrier": False,
    },
}
OURS = {
    "moe_configs": {"capacity_factor"},  # the whole table is metaopt's
    "recompute_configs": {
        "enable_partition",
        "policy",
        "keep_op_types",
        "memory_budget",
        "budget_batch_size",
        "offload_checkpoints",
        "recompute_head",
        "seed_random_ops",
    },
    "pipeline_configs": {"cuts", "num_stages", "dp_degree", "shared", "chunks"},
    "tensor_parallel_configs": {"column", "one_process_dropout", "row", "sequence_parallel", "vocab"},
}


def test_defaults_equal_fleet():
    s = fleet.DistributedStrategy()
    assert s.to_dict() == FLEET_DEFAULTS
    for name, value in FLEET_DEFAULTS.items():
        assert getattr(s, name) == value, name
    assert type(s.amp_configs["init_loss_scaling"]) is float
    assert type(s.fuse_grad_size_in_MB) is int


def test_extras_are_marked_as_ours():
    for flag, table in ALL_CONFIGS.items():
        assert {k for k, key in table.items() if key.extra} == OURS.get(f"{flag}_configs", set())
    ours = {name for name, key in FIELDS.items() if key.extra}
    assert ours == {"fuse_linear_cross_entropy", "optimizer_in_backward", "cuda_graph"}
    assert all(key.doc for key in FIELDS.values())


def test_unknown_config_key_has_did_you_mean():
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=r"strategy\.recompute_configs: unknown key 'checkpoint'") as e:
        s.recompute_configs = {"checkpoint": ["fc1"]}
    assert "did you mean 'checkpoints'" in str(e.value)
    assert s.recompute_configs == FLEET_DEFAULTS["recompute_configs"]  # unchanged


@pytest.mark.parametrize(
    "key, value",
    [("init_loss_scaling", float("inf")), ("incr_ratio", float("inf")), ("decr_ratio", float("nan"))],
)
def test_non_finite_floats_are_refused(key, value):
    # init_loss_scaling=inf passed "> 0", and then every step was skipped forever (inf * decr_ratio)
    s = fleet.DistributedStrategy()
    want = rf"strategy\.amp_configs\['{key}'\]: expected float, got {value!r} \(must be finite\)"
    with pytest.raises(TypeError, match=want):
        s.amp_configs = {key: value}
    assert s.amp_configs["init_loss_scaling"] == 32768.0  # unchanged


@pytest.mark.parametrize(
    "config, key, value, expected, got",
    [
        ("amp_configs", "init_loss_scaling", "1024", "float", "str"),
        ("amp_configs", "init_loss_scaling", True, "float", "bool"),  # bool is not a number here
        ("amp_configs", "incr_every_n_steps", True, "int", "bool"),
        ("amp_configs", "incr_every_n_steps", 10.0, "int", "float"),
        ("amp_configs", "use_pure_fp16", 1, "bool", "int"),
        ("gradient_merge_configs", "k_steps", "4", "int", "str"),
        ("pipeline_configs", "num_stages", 2.0, r"int\|None", "float"),
        ("recompute_configs", "checkpoint_shape", [2, "4"], r"list\[int\]", "str"),
    ],
)
def test_wrong_config_type_names_key_expected_and_got(config, key, value, expected, got):
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match=rf"strategy\.{config}\['{key}'\]: expected {expected}, .*{got}"):
        setattr(s, config, {key: value})


def test_ints_accepted_where_floats_expected():
    s = fleet.DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024, "incr_ratio": 3}
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert type(s.amp_configs["init_loss_scaling"]) is float
    assert type(s.amp_configs["incr_ratio"]) is float


def test_wrong_top_level_type():
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match=r"strategy\.recompute: expected bool, got int"):
        s.recompute = 1
    with pytest.raises(TypeError, match=r"strategy\.fuse_grad_size_in_MB: expected int, got bool"):
        s.fuse_grad_size_in_MB = True
    with pytest.raises(TypeError, match=r"strategy\.amp_configs: expected a dict, got list"):
        s.amp_configs = [("incr_ratio", 2.0)]
    assert s == fleet.DistributedStrategy()


def test_values_are_range_and_choice_checked():
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=r"gradient_merge_configs\['k_steps'\]: must be >= 1, got 0"):
        s.gradient_merge_configs = {"k_steps": 0}
    with pytest.raises(
        ValueError, match=r"schedule_mode'\]: 'FthenB' is not one of .*did you mean 'FThenB' or 'F-then-B'"
    ):
        s.pipeline_configs = {"schedule_mode": "FthenB"}
    with pytest.raises(ValueError, match=r"decr_ratio'\]: must be in \(0, 1\)"):
        s.amp_configs = {"decr_ratio": 1.5}


# Every numeric field and config key (issue 17's audit), with values out of its range and why
# each would stall or misdrive training. A new numeric key without a range fails
# test_every_numeric_key_has_a_range; add it here with its bad values.
_INT32_TOO_BIG = 2**31
OUT_OF_RANGE = {
    "fuse_grad_size_in_MB": [0, -32, _INT32_TOO_BIG],
    "nccl_comm_num": [0, _INT32_TOO_BIG],
    "amp_configs.init_loss_scaling": [0, 0.0, -1.0, 1e39, 1e-40],  # 1e39: inf in float32; 1e-40: 1/x inf
    "amp_configs.incr_every_n_steps": [0, -1, 2**40],  # int32 0 >= 2**40 is True in torch: grew every step
    "amp_configs.decr_every_n_nan_or_inf": [0, _INT32_TOO_BIG],
    "amp_configs.incr_ratio": [1.0, 0.5, 1.00000001, 1e39],  # 1 + 1e-8 is 1.0 in float32: never grows
    "amp_configs.decr_ratio": [0.0, 1.0, 0.99999999, 1e-50],  # 1 - 1e-8 is 1.0 in float32: never shrinks
    "recompute_configs.checkpoint_shape": [[0, 4], [-2, 4], [4, _INT32_TOO_BIG]],
    "recompute_configs.memory_budget": [0, -1],
    "recompute_configs.budget_batch_size": [0],
    "pipeline_configs.micro_batch_size": [0, _INT32_TOO_BIG],
    "pipeline_configs.accumulate_steps": [0, -4, _INT32_TOO_BIG],
    "pipeline_configs.chunks": [0],
    "pipeline_configs.num_stages": [0],
    "pipeline_configs.dp_degree": [0],
    "gradient_merge_configs.k_steps": [0, _INT32_TOO_BIG, 10**9],  # 10**9: never updates (issue 47)
    "tensor_parallel_configs.tensor_parallel_degree": [0, _INT32_TOO_BIG],
    "tensor_parallel_configs.tensor_init_seed": [-2, _INT32_TOO_BIG],
    "hybrid_configs.dp_degree": [0, -2, _INT32_TOO_BIG],  # -1 is the default: inferred
    "hybrid_configs.mp_degree": [0, -1, _INT32_TOO_BIG],
    "hybrid_configs.pp_degree": [0, _INT32_TOO_BIG],
    "hybrid_configs.sharding_degree": [0],
    "hybrid_configs.ep_degree": [0, -1],
    "hybrid_configs.sep_degree": [0, -1],
    "hybrid_configs.cp_degree": [0, -1],
    "moe_configs.capacity_factor": [0.0, -1.0, 1e300],
    "hybrid_configs.moe_sharding_degree": [0, -2],
    "sharding_configs.segment_broadcast_MB": [0.0, -1.0, 2.0**32],
    "lamb_configs.lamb_weight_decay": [-0.01, 1e300],  # 1e300: a float32 overflow (issue 47)
    "localsgd_configs.k_steps": [0, 10**9],  # never averages (issue 47)
    "localsgd_configs.begin_step": [0],
    "lars_configs.lars_coeff": [-1.0, 1e300],  # 1e300: a float32 overflow (issue 47)
    "lars_configs.lars_weight_decay": [-1.0, 1e300],  # 1e300: a float32 overflow (issue 47)
    "lars_configs.epsilon": [-1.0, 1e300],  # 1e300: a float32 overflow (issue 47)
    "sharding_configs.sharding_degree": [0, _INT32_TOO_BIG],
    "sharding_configs.stage": [0, 4],
    "sharding_configs.gradient_merge_acc_step": [0],
    "sharding_configs.mp_degree": [0],
    "sharding_configs.dp_degree": [0],
    "sharding_configs.pp_degree": [0],
    "fuse_grad_size_in_num": [0, _INT32_TOO_BIG],
    "last_comm_group_size_MB": [0.0, -1.0],
    "hierarchical_allreduce_inter_nranks": [0, _INT32_TOO_BIG],
    "conv_workspace_size_limit": [0, _INT32_TOO_BIG],
    "build_strategy.reduce_strategy": [-1, 3],
    "execution_strategy.num_threads": [0, _INT32_TOO_BIG],
    "execution_strategy.num_iteration_per_drop_scope": [0],
    "execution_strategy.num_iteration_per_run": [0],
    **{
        f"{table}.{k}": [_INT32_TOO_BIG]
        for table in ("dgc_configs", "adaptive_localsgd_configs", "a_sync_configs", "qat_configs")
        for k, key in TABLES[table].items()
        if key.type == "int"
    },
}


def _numeric(key) -> bool:
    return key.type.split("|")[0] in ("int", "float", "list[int]")


def test_every_numeric_key_has_a_range():
    numeric = [name for name, key in FIELDS.items() if _numeric(key)]
    numeric += [f"{table}.{k}" for table, t in TABLES.items() for k, key in t.items() if _numeric(key)]
    assert sorted(numeric) == sorted(OUT_OF_RANGE)
    for path in numeric:
        config, _, name = path.rpartition(".")
        key = FIELDS[name] if not config else TABLES[config][name]
        assert key.check, f"{path} has no range check"


@pytest.mark.parametrize("path, value", [(p, v) for p, vs in OUT_OF_RANGE.items() for v in vs])
def test_out_of_range_numbers_are_refused_naming_the_key(path, value):
    s = fleet.DistributedStrategy()
    config, _, name = path.rpartition(".")
    where = rf"strategy\.{config}\['{name}'\]" if config else rf"strategy\.{name}"
    if config in ("build_strategy", "execution_strategy"):  # objects: attribute-style
        where = rf"strategy\.{config}\.{name}"
    with pytest.raises(ValueError, match=rf"^{where}: (every dim )?must be .*, got "):
        if config:
            setattr(s, config, {name: value})
        else:
            setattr(s, name, value)
    assert s == fleet.DistributedStrategy()  # nothing changed


def test_fleet_defaults_and_edges_of_the_ranges_are_accepted():
    s = fleet.DistributedStrategy()
    s.amp_configs = {
        "init_loss_scaling": 2.0**127,  # a huge but float32 scale: a dynamic scaler shrinks it
        "incr_ratio": 1.001,
        "decr_ratio": 0.999,
        "incr_every_n_steps": 2**31 - 1,
        "decr_every_n_nan_or_inf": 1,
    }
    s.recompute_configs = {"checkpoint_shape": [-1, 128, 768]}  # Fleet: -1 for the batch dim
    s.fuse_grad_size_in_MB = 2**31 - 1
    assert s.amp_configs["init_loss_scaling"] == 2.0**127
    assert s.recompute_configs["checkpoint_shape"] == [-1, 128, 768]


def test_a_strategy_file_with_a_stalling_value_is_refused_naming_file_and_key(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"amp": True, "amp_configs": {"init_loss_scaling": 0}}))
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*init_loss_scaling'\]: must be > 0"):
        s.load_from_json(path)
    assert s == fleet.DistributedStrategy()  # all or nothing


def test_unknown_attribute_has_did_you_mean():
    s = fleet.DistributedStrategy()
    with pytest.raises(AttributeError, match=r"no attribute 'recompue' \(did you mean 'recompute'"):
        s.recompue = True
    with pytest.raises(AttributeError, match=r"no attribute 'amp_config' \(did you mean 'amp_configs'"):
        _ = s.amp_config
    with pytest.raises(AttributeError, match="asp meta optimizer"):
        s.asp_configs = {}  # Fleet has none either; the flag itself is a field
    assert not hasattr(s, "recompue")
    assert s == fleet.DistributedStrategy()


def test_assigning_a_config_replaces_it_with_defaults_plus_given_keys():
    s = fleet.DistributedStrategy()
    s.recompute_configs = {"checkpoints": ["fc1"], "enable_offload": True, "checkpoint_shape": [4, 8]}
    s.recompute_configs = {"checkpoints": ["fc2"]}
    # Fleet would keep enable_offload=True and checkpoint_shape=[4, 8] here (it merges).
    assert s.recompute_configs == {**FLEET_DEFAULTS["recompute_configs"], "checkpoints": ["fc2"]}


def test_configs_read_back_are_read_only():
    s = fleet.DistributedStrategy()
    s.recompute_configs = {"checkpoints": ["fc1"]}
    with pytest.raises(TypeError, match=r"read-only.*strategy\.amp_configs = \{\*\*strategy\.amp_configs"):
        s.amp_configs["incr_ratio"] = 3.0
    with pytest.raises(TypeError, match="read-only"):
        s.recompute_configs["checkpoints"].append("fc2")
    with pytest.raises(TypeError, match="read-only"):
        s.recompute_configs.update(checkpoints=[])
    assert s.recompute_configs["checkpoints"] == ["fc1"]
    # the documented idiom works, and copies are plain (mutable) containers
    s.recompute_configs = {**s.recompute_configs, "enable_offload": True}
    assert s.recompute_configs["enable_offload"] and s.recompute_configs["checkpoints"] == ["fc1"]
    c = copy.deepcopy(s.recompute_configs)
    c["checkpoints"].append("fc2")
    assert type(c) is dict and s.recompute_configs["checkpoints"] == ["fc1"]


def test_checkpoints_accept_vars_tuples_and_auto():
    s = fleet.DistributedStrategy()
    s.recompute_configs = {"checkpoints": (Var("fc1", "float32", (2,)), "encoder.layer.*")}
    assert s.recompute_configs["checkpoints"] == ["fc1", "encoder.layer.*"]
    s.recompute_configs = {"checkpoints": "auto", "memory_budget": 2**30}
    assert s.recompute_configs["checkpoints"] == ["auto"]
    with pytest.raises(TypeError, match=r"a single checkpoint must still be a list: \['fc1'\]"):
        s.recompute_configs = {"checkpoints": "fc1"}
    s.pipeline_configs = {"shared": ["wte.weight", ["a.w", "b.w"]]}
    assert s.pipeline_configs["shared"] == ["wte.weight", ["a.w", "b.w"]]


def _sections(text: str) -> list[str]:
    return [m.strip() for m in re.findall(r"^\s*\|\s*(\w+=True <-> \w+)\s*\|$", text, re.M)]


def test_printed_table_lists_exactly_the_enabled_sections():
    s = fleet.DistributedStrategy()
    text = str(s)
    assert "DistributedStrategy Overview" in text
    assert _sections(text) == []
    assert "Environment Flags" not in text

    s.recompute = True
    s.recompute_configs = {"checkpoints": ["fc1", "fc2"], "enable_offload": True}
    s.gradient_merge = True
    s.pipeline_configs = {"micro_batch_size": 4}  # pipeline off: its config is not shown
    text = str(s)
    assert _sections(text) == [
        "recompute=True <-> recompute_configs",
        "gradient_merge=True <-> gradient_merge_configs",
    ]
    assert "micro_batch_size" not in text and "init_loss_scaling" not in text
    assert re.search(r"^\s*\|\s+checkpoints\s+fc1\s+\|$", text, re.M)
    assert re.search(r"^\s*\|\s+fc2\s+\|$", text, re.M)  # list items one per row, as Fleet prints
    assert re.search(r"^\s*\|\s+enable_offload\s+True\s+\|$", text, re.M)
    assert re.search(r"^\s*\|\s+k_steps\s+1\s+\|$", text, re.M)
    assert "Environment Flags" not in text

    s.nccl_comm_num = 2
    text = repr(s)
    assert "Environment Flags, Communication Flags" in text
    assert re.search(r"^\s*\|\s+nccl_comm_num\s+2\s+\|$", text, re.M)
    assert "fuse_all_reduce_ops" not in text  # at its default
    widths = {len(line) for line in text.splitlines()}
    assert len(widths) == 1  # a box


def _everything_changed() -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.amp = s.recompute = s.pipeline = s.gradient_merge = True
    s.fuse_all_reduce_ops = False
    s.fuse_grad_size_in_MB = 64
    s.sharding = True
    s.amp_configs = {
        "init_loss_scaling": 1024,
        "decr_ratio": 0.5,
        "custom_white_list": ["MatMul"],
        "dtype": "bfloat16",
    }
    s.recompute_configs = {
        "checkpoints": ["a", "b"],
        "enable_offload": True,
        "checkpoint_shape": [4, 8],
        "memory_budget": 123,
        "offload_checkpoints": ["a"],
        "seed_random_ops": False,
        "policy": "selective",
        "keep_op_types": ["Softmax"],
    }
    s.pipeline_configs = {"schedule_mode": "F-then-B", "num_stages": 2, "shared": [["x", "y"]]}
    s.gradient_merge_configs = {"k_steps": 4, "avg": False}
    s.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}
    return s


def test_json_round_trip_is_exact(tmp_path):
    s = _everything_changed()
    path = tmp_path / "strategy.json"
    s.save_to_json(path)
    assert json.loads(path.read_text())["recompute_configs"]["checkpoints"] == ["a", "b"]
    t = fleet.DistributedStrategy()
    t.load_from_json(path)
    assert t == s
    assert t.to_dict() == s.to_dict()
    assert t.amp_configs["decr_ratio"] == 0.5 and t.pipeline_configs["shared"] == [["x", "y"]]
    assert os.listdir(tmp_path) == ["strategy.json"]  # the temp file was renamed over
    # and loading resets fields the file leaves out
    path.write_text(json.dumps({"amp": True}))
    t.load_from_json(path)
    assert t.to_dict() == {**FLEET_DEFAULTS, "amp": True}


def test_equality_compares_every_field():
    a, b = fleet.DistributedStrategy(), fleet.DistributedStrategy()
    assert a == b
    b.gradient_merge_configs = {"avg": False}
    assert a != b
    b.gradient_merge_configs = {}
    assert a == b
    b.without_graph_optimization = False
    assert a != b
    assert copy.deepcopy(_everything_changed()) == _everything_changed()


@pytest.mark.parametrize(
    "data, match",
    [
        ({"recompue": True}, r"unknown field 'recompue' \(did you mean 'recompute'"),
        ({"amp_configs": {"incr_ration": 2.0}}, r"unknown key 'incr_ration' \(did you mean 'incr_ratio'"),
        ({"amp": "yes"}, r"strategy\.amp: expected bool, got str"),
    ],
)
def test_load_from_json_with_an_unknown_key_errors_and_changes_nothing(tmp_path, data, match):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"recompute": True, **data}))
    s = fleet.DistributedStrategy()
    s.pipeline = True
    with pytest.raises((ValueError, TypeError), match=match) as e:
        s.load_from_json(path)
    assert str(path) in str(e.value)
    assert s.pipeline and not s.recompute


def test_load_from_json_rejects_non_json(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("recompute: true\n")
    with pytest.raises(ValueError, match="not a JSON strategy file"):
        fleet.DistributedStrategy().load_from_json(path)


def test_unsupported_features_are_fields():
    s = fleet.DistributedStrategy()
    for name in UNSUPPORTED_FEATURES:
        setattr(s, name, True)
        assert getattr(s, name) is True


# --- fields metaopt has no code for (issue 13): refused at minimize, never silently ignored -----


def test_cuda_graphs_are_refused_by_name_until_they_are_written():
    """Issue 30's whole-step CUDA graphs need a GPU to be written against: until then the
    strategy field and the executor's keyword are refused, never silently ignored."""
    s = fleet.DistributedStrategy()
    s.cuda_graph = True
    (e,) = unimplemented(s)
    assert str(e).startswith("strategy.cuda_graph=True: not implemented in metaopt (each step runs op by op")
    with pytest.raises(NotImplementedError, match=r"Executor\(cuda_graph=True\): whole-step CUDA-graph"):
        metaopt.Executor("cpu", cuda_graph=True)


def test_unimplemented_top_level_field_is_refused_naming_it():
    s = fleet.DistributedStrategy()
    s.nccl_comm_num = 2  # accepted here (a Fleet script still runs) ...
    (e,) = unimplemented(s)  # ... and refused at minimize
    assert isinstance(e, NotImplementedError)
    assert str(e) == (
        "strategy.nccl_comm_num=2: not implemented in metaopt (all-reduces run on one "
        "communicator); leave it at its default 1"
    )
    assert [str(x) for x in s.unimplemented()] == [str(e)]  # the method is the same list
    s.sync_nccl_allreduce = False
    s.without_graph_optimization = False
    assert [str(e).split(":")[0] for e in unimplemented(s)] == [
        "strategy.nccl_comm_num=2",
        "strategy.sync_nccl_allreduce=False",
        "strategy.without_graph_optimization=False",
    ]


def test_unimplemented_config_key_is_refused_naming_it_while_its_feature_is_on():
    s = fleet.DistributedStrategy()
    s.tensor_parallel_configs = {"tensor_parallel_degree": 2, "tensor_init_seed": 7}
    assert unimplemented(s) == []  # tensor parallel off: the config is unused (the plan warns)
    s.tensor_parallel = True
    (e,) = unimplemented(s)
    assert isinstance(e, NotImplementedError)
    assert str(e).startswith(
        "strategy.tensor_parallel_configs['tensor_init_seed']=7: not implemented in metaopt ("
    )
    assert "slices its params" in str(e) and str(e).endswith("leave it at its default -1")


def test_defaults_are_not_refused():
    s = fleet.DistributedStrategy()
    s.pipeline = True
    assert unimplemented(s) == []
    # a Fleet script that spells the defaults out is fine too
    s.nccl_comm_num = 1
    s.sync_nccl_allreduce = True
    s.without_graph_optimization = True
    s.pipeline_configs = {"micro_batch_size": 1, "accumulate_steps": 4}
    assert unimplemented(s) == []


def test_no_effect_fields_are_accepted_with_either_value():
    s = fleet.DistributedStrategy()
    s.pipeline = True
    s.find_unused_parameters = True
    s.pipeline_configs = {"p2p_cache_shape": False}
    assert unimplemented(s) == []


def test_unimplemented_and_no_effect_rows_name_real_fields():
    for path in (*UNIMPLEMENTED, *NO_EFFECT):
        config, _, name = path.rpartition(".")
        if config:
            assert name in TABLES[config], path
        else:
            assert name in FIELDS, path
    assert not set(UNIMPLEMENTED) & set(NO_EFFECT)
    assert not set(UNIMPLEMENTED) & set(UNSUPPORTED_FEATURES)
    assert all(UNIMPLEMENTED.values()) and all(NO_EFFECT.values())


# gradient_merge raises NotImplementedError as a whole until it is implemented (then it reads these)
_PENDING = {"gradient_merge_configs.k_steps", "gradient_merge_configs.avg"}


def test_every_field_and_config_key_is_read_or_refused():
    """The audit of issue 13 as a test: each field and config key is named somewhere in
    metaopt outside strategy.py (``.name`` or ``'name'``), or is refused (UNSUPPORTED_FEATURES,
    UNIMPLEMENTED) or has no effect by design (NO_EFFECT). A mention is not proof of a read,
    but a key never mentioned is certainly never read."""
    root = Path(metaopt.__file__).parent
    strategy_py = root / "fleet" / "strategy.py"
    text = "\n".join(p.read_text(encoding="utf-8") for p in root.rglob("*.py") if p != strategy_py)
    accounted = {*UNSUPPORTED_FEATURES, *UNIMPLEMENTED, *NO_EFFECT, *_PENDING}
    accounted |= {f"{t}.{k}" for t in REFUSED_CONFIGS for k in TABLES[t]}  # every key refused
    paths = [*FIELDS, *(f"{table}.{k}" for table, t in TABLES.items() for k in t)]
    unread = []
    for path in paths:
        name = path.rpartition(".")[2]
        if path not in accounted and not re.search(rf"\.{name}\b|[\"']{name}[\"']", text):
            unread.append(path)
    assert unread == [], (
        f"strategy fields/keys nothing reads: {unread}; implement them, or add them to "
        "UNIMPLEMENTED (refused when not at the default) or NO_EFFECT in metaopt/fleet/strategy.py"
    )


def test_unimplemented_values_still_load_and_print_as_refused(tmp_path):
    s = fleet.DistributedStrategy()
    s.pipeline = True
    s.nccl_comm_num = 2
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"tensor_init_seed": 4}
    s.dgc = True
    path = tmp_path / "s.json"
    s.save_to_json(path)
    t = fleet.DistributedStrategy()
    t.load_from_json(path)  # a saved strategy loads; minimize is where it is refused
    assert t == s and [str(e) for e in unimplemented(t)] == [str(e) for e in unimplemented(s)]
    text = str(t)
    assert "Not implemented in metaopt: refused at minimize" in text
    assert re.search(r"^\s*\|\s+nccl_comm_num\s+2, default 1\s+\|$", text, re.M)
    assert re.search(
        r"^\s*\|\s+tensor_parallel_configs\['tensor_init_seed'\]\s+4, default -1\s+\|$", text, re.M
    )
    assert re.search(r"^\s*\|\s+dgc\s+True, default False\s+\|$", text, re.M)
    assert len({len(line) for line in text.splitlines()}) == 1  # still a box
    assert "refused" not in str(fleet.DistributedStrategy())


# --- hybrid_configs (issue 16, topology): Fleet's keys and defaults, checked at assignment ------


def test_hybrid_configs_have_fleets_keys_defaults_and_did_you_mean():
    s = fleet.DistributedStrategy()
    ep = {
        "ep_degree": 1,
        "moe_sharding_degree": -1,
        "order": ["dp", "pp", "sharding", "sep", "mp"],
        "sep_degree": 1,
        "cp_degree": 1,
    }
    assert s.hybrid_configs == {"dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, **ep}
    s.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}  # replaced: the others at their defaults
    assert s.hybrid_configs == {"dp_degree": 2, "mp_degree": 1, "pp_degree": 2, "sharding_degree": 1, **ep}
    with pytest.raises(
        ValueError, match=r"strategy\.hybrid_configs: unknown key 'mp_degre' \(did you mean 'mp_degree'"
    ):
        s.hybrid_configs = {"mp_degre": 2}
    with pytest.raises(TypeError, match=r"strategy\.hybrid_configs\['pp_degree'\]: expected int, got float"):
        s.hybrid_configs = {"pp_degree": 2.0}
    with pytest.raises(
        ValueError, match=r"strategy\.hybrid_configs\['dp_degree'\]: must be >= 1, or -1 .*got 0"
    ):
        s.hybrid_configs = {"dp_degree": 0}
    with pytest.raises(TypeError, match=r"strategy\.hybrid_configs\['mp_degree'\]: expected int, got bool"):
        s.hybrid_configs = {"mp_degree": True}
    assert s.hybrid_configs["pp_degree"] == 2  # a refused assignment changes nothing
    with pytest.raises(TypeError, match=r"strategy\.hybrid_configs is read-only"):
        s.hybrid_configs["dp_degree"] = 4


def test_paddles_context_parallel_degree_lays_its_groups_on_the_sequence_axis():
    """cp_degree (context parallel, tests/passes/test_context_parallel.py) takes the layout's
    sequence axis, where sep sits: the cp group is hcg's sep group; sep_degree beside it above 1
    is refused by name (both would split every sequence)."""
    from metaopt.fleet.topology import from_hybrid_configs

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"cp_degree": 2, "dp_degree": 2}
    assert not s.unimplemented()
    topo = from_hybrid_configs(s.hybrid_configs, 4)
    assert (topo.cp_degree, topo.exchange_degree, topo.sep_degree, topo.ring) == (2, 1, 2, True)
    assert "cp_degree=2" in topo.describe() and "sep_degree" not in topo.describe()
    assert topo.group_ranks("sep", 0) == [0, 1] and topo.group_ranks("data", 0) == [0, 2]
    plain = from_hybrid_configs({**s.hybrid_configs, "cp_degree": 1, "sep_degree": 2}, 4)
    assert (plain.cp_degree, plain.exchange_degree, plain.ring) == (1, 2, False)
    with pytest.raises(NotImplementedError, match=r"sep_degree=2 and cp_degree=2: both split every sequence"):
        from_hybrid_configs({**s.hybrid_configs, "sep_degree": 2, "dp_degree": 1}, 4)
    with pytest.raises(ValueError, match=r"dp_degree=3 x mp_degree=1 x pp_degree=1 x cp_degree=2 = 6 work"):
        from_hybrid_configs({**s.hybrid_configs, "dp_degree": 3}, 4)


def test_hybrid_configs_print_once_set_and_none_prints_as_refused():
    s = fleet.DistributedStrategy()
    assert "hybrid_configs" not in str(s)  # at Fleet's defaults: nothing to show
    s.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}
    text = str(s)
    assert re.search(r"^\s*\|\s+hybrid_configs\s+\|$", text, re.M)
    assert re.search(r"^\s*\|\s+dp_degree\s+2\s+\|$", text, re.M)
    assert re.search(r"^\s*\|\s+pp_degree\s+2\s+\|$", text, re.M)
    assert "refused" not in text and len({len(line) for line in text.splitlines()}) == 1
    s.hybrid_configs = {"mp_degree": 2, "sharding_degree": 2}
    text = str(s)
    assert not re.search(r"hybrid_configs\['mp_degree'\]\s+2, default 1", text)  # served: tensor parallel
    assert "refused" not in text  # sharding_degree: served by strategy.sharding (ZeRO)


def test_sharding_configs_refuse_their_unimplemented_keys_by_name_only_while_sharding_is_on():
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2, "sharding_degree": 4}
    assert unimplemented(s) == []  # hybrid sharding_degree lays out the ZeRO group
    s.sharding_configs = {"optimize_cast": True, "sharding_degree": 4}
    assert unimplemented(s) == []  # the feature is off: its config is unused
    s.sharding = True
    (e,) = unimplemented(s)
    assert isinstance(e, NotImplementedError)
    assert str(e).startswith("strategy.sharding_configs['optimize_cast']=True: not implemented in metaopt")
    assert unimplemented(s, "hybrid_configs") == []


def test_tensor_init_seed_is_refused_while_tensor_parallel_is_on():
    s = fleet.DistributedStrategy()
    s.tensor_parallel_configs = {"tensor_init_seed": 7}
    assert unimplemented(s) == []  # the feature is off: its config is unused
    s.tensor_parallel = True
    (e,) = unimplemented(s)
    assert str(e).startswith("strategy.tensor_parallel_configs['tensor_init_seed']=7: not implemented")


# Fleet 2.x's DistributedStrategy feature switches (its documented boolean properties): each is a
# field here, so a Fleet script sets it without an AttributeError, and minimize either honours it
# or refuses it naming why. (Every other documented field, execution_strategy, build_strategy and
# the cudnn_* and all-reduce tuning fields included: tests/fleet/test_fleet_fields.py.)
FLEET_SWITCHES = [
    "amp", "recompute", "pipeline", "gradient_merge", "sharding", "tensor_parallel", "lamb", "lars",
    "localsgd", "adaptive_localsgd", "dgc", "fp16_allreduce", "a_sync", "heter_ccl_mode",
    "sync_batch_norm", "asp", "qat", "elastic", "auto", "semi_auto", "use_hierarchical_allreduce",
    "fuse_grad_merge", "fuse_all_reduce_ops", "sync_nccl_allreduce", "find_unused_parameters",
    "without_graph_optimization",
]  # fmt: skip


def test_every_fleet_switch_is_a_field_honoured_or_refused_with_its_reason():
    honoured = {
        "amp",
        "recompute",
        "pipeline",
        "gradient_merge",
        "sharding",
        "tensor_parallel",
        "lamb",
        "lars",
    }
    honoured |= {"localsgd", "fp16_allreduce", "fuse_all_reduce_ops"}
    for name in FLEET_SWITCHES:
        assert name in FIELDS, name
        refused = name in UNSUPPORTED_FEATURES or name in UNIMPLEMENTED or name in NO_EFFECT
        assert (name in honoured) != refused, name
    assert all(why for why in UNSUPPORTED_FEATURES.values())
