"""Fold torch's exported Linear back into one op: Transpose(W) -> MatMul -> Add(b) => Linear(x, W, b).

torch.onnx.export writes an nn.Linear on a >2-D input as three ops; running them
as such costs a separate pass over the output for the bias (and a transposed
view per step). `Linear` (ours, saved with an ONNX function body) is one
`F.linear` call, as in eager torch. Only params qualify (a transposed activation
is a real computation), only with a bias (without one, MatMul on the transposed
view is already F.linear's single BLAS call), and only when the intermediate
values have no other reader.
"""

from __future__ import annotations

from metaopt.ir import Op, Program


def fuse_linear(p: Program) -> Program:
    q = p.clone()
    consumers = q.consumers()
    producer = q.producers()
    drop: set[int] = set()
    replace: dict[int, Op] = {}
    for i, op in enumerate(q.ops):
        if op.type != "MatMul" or len(op.inputs) != 2 or op.role != "forward":
            continue
        t_idx = producer.get(op.inputs[1])
        if t_idx is None:
            continue
        t = q.ops[t_idx]
        w = t.inputs[0] if t.type == "Transpose" else None
        if (
            w is None
            or q.vars[w].kind != "param"
            or len(q.vars[w].shape or ()) != 2
            or t.attrs.get("perm") != [1, 0]
            or consumers.get(t.outputs[0]) != [i]
        ):
            continue
        # Without a bias there is nothing to gain: MatMul on the transposed view is
        # already the one BLAS call F.linear makes.
        readers = consumers.get(op.outputs[0], [])
        add = q.ops[readers[0]] if len(readers) == 1 else None
        bias = next((x for x in add.inputs if x != op.outputs[0]), None) if add is not None else None
        if (
            add is None
            or add.type != "Add"
            or bias is None
            or q.vars[bias].kind != "param"
            or q.vars[bias].shape != (q.vars[w].shape[0],)
        ):
            continue
        drop.update((t_idx, readers[0]))
        replace[i] = Op(
            "Linear", [op.inputs[0], w, bias], list(add.outputs), {}, role=op.role, scope=add.scope
        )
    q.ops = [replace.get(i, op) for i, op in enumerate(q.ops) if i not in drop or i in replace]
    produced = {o for op in q.ops for o in op.outputs}
    for op in [p.ops[i] for i in drop] + [p.ops[i] for i in replace]:
        for name in op.outputs:
            if name not in produced:
                q.vars.pop(name, None)
    return q
