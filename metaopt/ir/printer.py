"""The golden text format: what `print(program)` shows and `parser` reads back.

    program mlp
    inputs: x, y
    outputs: loss
    loss: loss
    vars:
      x: float32[batch,16] input
      fc1.weight: float32[32,16] param
      fc2.weight: float32[16,32] param split(axis=0, parts=2, blocks=[32])
      h: float32[batch,32]
    modules:
      fc1: h
    updates:
      bn.running_mean <- bn/running_mean
    ops:
      h = Gemm(x, fc1.weight, fc1.bias, transB=1)  # role=forward scope=fc1

A var holding one worker's part of a larger tensor (tensor parallel) shows its layout,
``split(axis, parts, blocks)`` (`metaopt.ir.program.Split`), after its kind; the shape is the
worker's own. A ZeRO-sharded var (a worker's flat 1/parts of a tensor) shows
``zero_shard(parts, full)`` (`metaopt.ir.program.ZeroShard`) there instead. A var only
kernels on one kind of device make (`Var.device`: a fused op's
saved outputs per device) ends with ``on cpu`` or ``on cuda``. One op per line; the comment
holds the op's fields. Names (and dims) outside ``[A-Za-z0-9_.@/*+-]`` are JSON-quoted; an
omitted optional input is ``~``.
Constants with at most `INLINE_VALUES` elements show their value; larger
values (weights) are not part of the text.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from metaopt.ir.program import Op, Program, Var, dtype_name

INLINE_VALUES = 8
COMMENT_COLUMN = 44
_NAME_RE = re.compile(r"[A-Za-z0-9_.@/*+\-]+")
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_WORDS = frozenset({"True", "False", "None", "inf", "nan", "tensor"})


def fmt_name(name: str) -> str:
    if name == "":
        return "~"
    if _NAME_RE.fullmatch(name) and name != "~":
        return name
    return json.dumps(name)


def fmt_shape(shape: tuple | None) -> str:
    if shape is None:
        return "[?]"
    return (
        "["
        + ",".join(str(d) if isinstance(d, int) or _NAME_RE.fullmatch(d) else json.dumps(d) for d in shape)
        + "]"
    )


def fmt_value(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v)
    if isinstance(v, str):
        if _WORD_RE.fullmatch(v) and v not in RESERVED_WORDS:
            return v
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    if isinstance(v, torch.Tensor):
        flat = v.detach().cpu().reshape(-1)
        if v.dtype == torch.bfloat16 or v.dtype == torch.float16:
            flat = flat.float()
        return f"tensor({dtype_name(v.dtype)}, {fmt_shape(tuple(v.shape))}, {fmt_value(flat.tolist())})"
    raise TypeError(f"cannot print attribute value of type {type(v).__name__}: {v!r}")


def fmt_var(var: Var, value: torch.Tensor | None) -> str:
    s = f"{fmt_name(var.name)}: {var.dtype}{fmt_shape(var.shape)}"
    if var.kind != "activation":
        s += f" {var.kind}"
    if var.kind == "param" and not var.trainable:
        s += " frozen"
    if var.split is not None:  # one worker's part of a larger tensor (unsplit vars print as before)
        s += f" {var.split}"
    if var.zero is not None:  # one worker's flat 1/parts (ZeRO sharding)
        s += f" {var.zero}"
    if var.host:  # held in host memory between steps (ZeRO-Offload)
        s += " host"
    if var.device is not None:  # made by kernels on that kind of device alone
        s += f" on {var.device}"
    # a constant of a meta export may be on meta (no data): printed like a large one, by type
    if var.kind == "constant" and value is not None and not value.is_meta and value.numel() <= INLINE_VALUES:
        t = value.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        s += " = " + fmt_value(t.tolist())
    return s


def fmt_op(op: Op) -> str:
    args = [fmt_name(x) for x in op.inputs]
    args += [f"{k}={fmt_value(v)}" for k, v in op.attrs.items()]
    call = f"{op.type}({', '.join(args)})"
    code = f"{', '.join(fmt_name(o) for o in op.outputs)} = {call}" if op.outputs else call
    fields = [f"role={op.role}"]
    if op.stage is not None:
        fields.append(f"stage={op.stage}")
    if op.scope:
        fields.append(f"scope={fmt_name(op.scope)}")
    if op.origin is not None:
        fields.append(f"origin={fmt_name(op.origin)}")
    return f"{code.ljust(COMMENT_COLUMN - 3)}  # {' '.join(fields)}"


def print_program(p: Program) -> str:
    lines = [f"program {fmt_name(p.name)}"]
    lines.append("inputs: " + ", ".join(fmt_name(x) for x in p.inputs))
    lines.append("outputs: " + ", ".join(fmt_name(x) for x in p.outputs))
    if p.loss_name is not None:
        lines.append(f"loss: {fmt_name(p.loss_name)}")
    if p.pipeline is not None:
        lines.append(f"pipeline: {p.pipeline}")
    if p.gradient_merge is not None:
        lines.append(f"gradient_merge: {p.gradient_merge}")
    lines.append("vars:")
    lines += ["  " + fmt_var(v, p.values.get(v.name)) for v in p.vars.values()]
    if p.modules:
        lines.append("modules:")
        lines += [f"  {fmt_name(m)}: {', '.join(fmt_name(x) for x in outs)}" for m, outs in p.modules.items()]
    if p.updates:
        lines.append("updates:")
        lines += [f"  {fmt_name(t)} <- {fmt_name(n)}" for t, n in p.updates.items()]
    lines.append("ops:")
    lines += ["  " + fmt_op(op) for op in p.ops]
    return "\n".join(lines) + "\n"
