"""Readable, deterministic var names and module outputs for an imported program.

The exporter's value names are FX names (``add_4``, ``getitem_12``) that shift
with export options. After import:

* a module's single output is named by the module path (``encoder.layer.3``),
  the outermost module winning when modules share an output;
* other values are ``<module path>/<op type>`` (``fc1/gemm``), with ``_1``,
  ``_2`` ... in program order keeping them unique (FX names are not used: they
  shift with export options);
* new values of updated state (BatchNorm running stats) are ``<state>@NEW``;
* constants are ``const``, ``const_1`` ...; the loss is ``loss``.

`Program.modules` maps every module path to its output vars, so
``"encoder.layer.*"`` can be resolved even for inner modules whose output shares
a name with their parent's.
"""

from __future__ import annotations

from metaopt.ir import Program, names


def with_uncalled_parents(mods: list[str]) -> list[str]:
    """An op's enclosing module paths (outermost first) with the ones the exporter skipped: a
    module whose parent calls its ``forward`` directly (SqueezeBERT's encoder runs
    ``layer.forward(...)``) records no scope of its own, though its children do. Between two
    recorded paths, a dotted path in between that ends in an index is such a module
    (``layers.0`` between ``encoder`` and ``encoder.layers.0.attention``): an element of a
    ModuleList or Sequential, what ``"layers.*"`` names. Other paths in between are not added:
    the container itself (``layers``, a ModuleList is never called) must not take its last
    element's output name; a named child called by ``.forward`` stays unaddressable (its
    children are)."""
    out: list[str] = []
    for m in mods:
        prev = out[-1] if out else ""
        if m.startswith(prev + ".") if prev else True:
            rest = m[len(prev) + 1 :].split(".") if prev else m.split(".")
            for k in range(1, len(rest)):
                if rest[k - 1].isdigit():
                    out.append(".".join(filter(None, [prev, *rest[:k]])))
        out.append(m)
    return out


def module_outputs(p: Program, chains: dict[str, list[str]]) -> dict[str, list[str]]:
    """module path -> vars produced inside it and read outside it (or program outputs)."""
    mods_of = {
        id(op): with_uncalled_parents(chains.get(op.outputs[0], [""])[:-1]) if op.outputs else []
        for op in p.ops
    }
    readers: dict[str, list[set[str]]] = {}
    for op in p.ops:
        for x in op.inputs:
            if x:
                readers.setdefault(x, []).append(set(mods_of[id(op)]))
    out: dict[str, list[str]] = {}
    for op in p.ops:
        for o in op.outputs:
            if not o:
                continue
            for m in mods_of[id(op)]:
                leaves = o in p.outputs or any(m not in r for r in readers.get(o, []))
                if leaves:
                    out.setdefault(m, []).append(o)
    return out


def readable_names(p: Program, chains: dict[str, list[str]]) -> None:
    """Rename in place (import time only: the program is not shared yet)."""
    mods = module_outputs(p, chains)
    keep = set(p.inputs) | {v.name for v in p.vars.values() if v.kind in ("param", "buffer")}
    new: dict[str, str] = {}
    taken = set(keep)

    def give(old: str, name: str) -> None:
        if old in new or old in keep:
            return
        new[old] = names.fresh(name, taken)
        taken.add(new[old])

    if p.loss_name is not None:
        give(p.loss_name, "loss")
    # Outer modules first, so a shared output is named after the outermost module.
    depth = {m: i for chain in chains.values() for i, m in enumerate(chain[:-1])}
    for m in sorted(mods, key=lambda m: (depth.get(m, 0), m)):
        if len(mods[m]) == 1 and m:
            give(mods[m][0], m)
    for target, o in p.updates.items():
        give(o, names.new_state(target))
    for op in p.ops:
        local = op.type.lower()
        for o in op.outputs:
            if o:
                give(o, f"{op.scope}/{local}" if op.scope else local)
    for v in p.vars.values():
        if v.kind == "constant":
            give(v.name, "const")
    _apply(p, new)
    p.modules = {m: [new.get(x, x) for x in outs] for m, outs in mods.items() if m}


def _apply(p: Program, new: dict[str, str]) -> None:
    def r(x: str) -> str:
        return new.get(x, x)

    vars_ = {}
    for v in p.vars.values():
        v.name = r(v.name)
        vars_[v.name] = v
    p.vars = vars_
    p.values = {r(k): t for k, t in p.values.items()}
    for op in p.ops:
        op.inputs = [r(x) for x in op.inputs]
        op.outputs = [r(x) for x in op.outputs]
        if op.origin is not None:
            op.origin = r(op.origin)
    p.inputs = [r(x) for x in p.inputs]
    p.outputs = [r(x) for x in p.outputs]
    p.loss_name = r(p.loss_name) if p.loss_name is not None else None
    p.updates = {r(k): r(v) for k, v in p.updates.items()}
