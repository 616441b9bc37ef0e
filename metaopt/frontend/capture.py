"""Step 1 of `metaopt.export`: capture the module with `torch.export.export`, ourselves.

torch.onnx.export would capture too, but it hides two things a training program needs:

* **A batch dim the code specializes** (a CLIP-style loss whose labels are ``arange(batch)``):
  torch.export refuses a ``Dim("batch")`` that became a constant, and the ONNX exporter then
  retries with the shapes relaxed and exports a fixed-batch program without a word. Here it is
  an `ExportError` naming the inputs and the source line that fixed the batch, and the cure:
  ``dynamic_batch=False`` for a fixed-batch program on purpose.
* **Repeated calls of one module** (ALBERT's shared layer, any weight-shared block): the ONNX
  exporter's scope metadata holds only the module's path, so every call looks like one. Its
  source, torch.export's ``nn_module_stack``, numbers later calls (``layer@1``, ``layer@2``);
  `index_module_calls` carries that number into the path, so each call's output is a module
  output of its own (``program.modules["layer@2"]``) and a checkpoint pattern sees every call.

`explain_failure` turns an exporter failure into an error naming the aten op, the module path
and the source line, from the exception summary torch prints.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch

SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"


class ExportError(RuntimeError):
    pass


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _shape_log():
    """The symbolic-shapes log of one capture (which input made which symbol, which line
    guarded it to a constant), kept from the user's console."""
    log = logging.getLogger(SHAPES_LOGGER)
    handler = _Records()
    saved = log.level, log.propagate, log.handlers[:]
    log.handlers[:] = [handler]  # torch's own handler would print these INFO lines
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield handler.messages
    finally:
        log.handlers[:] = saved[2]
        log.setLevel(saved[0])
        log.propagate = saved[1]


def capture(
    module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    with _shape_log() as messages:
        try:
            ep = torch.export.export(module, args, kwargs=kwargs or None, dynamic_shapes=dynamic_shapes)
        except torch._dynamo.exc.UserError as e:
            if dynamic_shapes and "Constraints violated (batch)" in str(e):
                raise ExportError(_batch_fixed(module, messages)) from None
            raise
    index_module_calls(ep)
    return ep


def _batch_fixed(module: torch.nn.Module, messages: list[str]) -> str:
    symbols: dict[str, str] = {}  # s72 -> the input whose dim it is
    for m in messages:
        hit = re.match(r"create_symbol (s\d+) = (\d+) for L\['(\w+)'\]", m)
        if hit:
            symbols[hit[1]] = hit[3]
    inputs: dict[str, None] = {}
    guard = where = None
    for m in messages:  # the first guard on a batch symbol that is not a plain range check
        hit = re.match(r"eval (.+?) \[guard added\] \((.*?)\)", m)
        if not hit:
            continue
        used = [symbols[s] for s in re.findall(r"s\d+", hit[1]) if s in symbols]
        if (
            used
            and not re.match(r"^s\d+ [<>]=? \d+$", hit[1])
            and not re.match(r"^Eq\(\d*\*?s\d+, \d*\*?s\d+\)$", hit[1])
        ):
            inputs.update(dict.fromkeys(used))
            guard, where = guard or hit[1], where or hit[2]
    names = ", ".join(repr(k) for k in inputs) or "the inputs"
    at = f" at {where}" if where else ""
    cond = f" (it requires {guard})" if guard else ""
    return (
        f"the batch dim of {type(module).__name__}'s {names} does not survive export: the code{at} "
        f"fixes it{cond}, e.g. labels from arange(<example batch>) or a reshape to the example's "
        "batch. Export with dynamic_batch=False for a program fixed at the example's batch size, or "
        "make that code batch-independent"
    )


def index_module_calls(ep: torch.export.ExportedProgram) -> None:
    """The k-th repeated call (k >= 1) of a module gets the path ``<path>@k`` in every node's
    ``nn_module_stack``, as torch.export numbers its keys; the first call keeps the path."""
    for node in ep.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        for key, (path, cls) in list(stack.items()):
            call = re.search(r"@(\d+)$", key)
            if call and path and not re.search(r"@\d+$", path):
                stack[key] = (f"{path}@{call[1]}", cls)


def explain_failure(module: torch.nn.Module, ep: torch.export.ExportedProgram | None, e: Exception) -> str:
    """One paragraph: the aten op, its module path, the source line and torch's own reason."""
    text = str(e)
    reason = re.search(r"<class '([\w.]+)'>: (.+)", text)
    node = re.search(r"While executing %(\w+) : .*?target=([\w.]+)", text)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', text)
    parts = [f"export of {type(module).__name__} failed"]
    if node:
        parts.append(f"at the aten op {node[2]} (node {node[1]})")
        scope = _node_scope(ep, node[1])
    else:  # no node named (an op with no ONNX translation): find the op in the captured graph
        overload = re.search(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)", text)
        scope = None
        if overload:
            target = f"{overload[1]}.{overload[2]}"
            parts.append(f"at the op {target}")
            scope = _node_scope(ep, target=target)
    if scope:
        parts.append(f"in module {scope!r}")
    if frames:
        f = frames[-1]
        parts.append(f"from {f[0]}:{f[1]} in {f[2]}: {f[3].strip()}")
    head = ", ".join(parts)
    why = f"{reason[1].rsplit('.', 1)[-1]}: {reason[2].strip()}" if reason else text.strip().splitlines()[0]
    return f"{head}: {why}"


def _node_scope(
    ep: torch.export.ExportedProgram | None, name: str | None = None, *, target: str | None = None
) -> str | None:
    """The module path of the node called `name`, or of the first calling `target`."""
    if ep is None:
        return None
    for node in ep.graph.nodes:
        if node.name == name or (target is not None and str(node.target) == target):
            stack = node.meta.get("nn_module_stack") or {}
            paths = [p for p, _ in stack.values() if p]
            return paths[-1] if paths else None
    return None
