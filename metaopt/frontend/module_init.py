"""A module's initial values made one submodule at a time, each from its own seed.

`module_values(module, seed=...)` walks `module` (typically built on the meta device) and yields
the value of every parameter and persistent buffer, made by the module's own initializer: Hugging
Face's ``_init_weights`` of the nearest pretrained model above the submodule (what
``from_pretrained`` runs after a meta build), else the submodule's ``reset_parameters()`` (torch's
convention, FSDP2's too), or an `init` of the caller's. A submodule's values are made on the host
in a copy of it (the caller's module is never changed) and dropped once yielded, so the process
holds one submodule's tensors at a time, never the whole model.

Each submodule draws from a generator seeded by (`seed`, its path), not from one stream over the
whole model: a submodule's values do not depend on which other submodules a process makes, so a
worker that makes only the submodules its pipeline stage holds, and one that makes all of them,
get the same values bitwise. (They are not the values of ``torch.manual_seed(seed)`` followed by
an eager build: that draws one stream in construction order.)
"""

from __future__ import annotations

import copy
import hashlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Init = Callable[[torch.nn.Module], None]


class ModuleInitError(ValueError):
    """A parameter or buffer that no initializer set: names it, its submodule and that's type."""


@dataclass(frozen=True)
class Made:
    """One value: every name it has in the module (tied parameters have several), its tensor."""

    names: tuple[str, ...]
    value: torch.Tensor


def module_seed(seed: int, path: str) -> int:
    """The seed of the submodule at `path`: a hash of both, so it is the same in every process."""
    digest = hashlib.sha256(f"{int(seed)}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sentinel(dtype: torch.dtype) -> float | int | bool:
    """A value no init writes everywhere: how an unset tensor is told from a set one."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def is_unset(t: torch.Tensor, fill: float | int | bool) -> bool:
    """Whether `t`, filled with `fill` before an init, still holds it (a float: any NaN left)."""
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    return bool((t == fill).all())


def is_hf_model(m: torch.nn.Module) -> bool:
    """A Hugging Face pretrained model (told by its class, without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def hf_init(path: str, modules: dict[str, torch.nn.Module]) -> Init | None:
    """The per-module init of the nearest model at or above `path` that has one: an
    ``_init_weights(module)`` method, the ``model.apply(model._init_weights)`` idiom of Hugging
    Face's pretrained models (``initialize_weights``) and of many models written like them."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        owner = modules.get(".".join(parts[:i]))
        f = getattr(owner, "_init_weights", None) if owner is not None else None
        if callable(f) and _required_args(f) == 1:
            return f
    return None


def module_values(
    module: torch.nn.Module,
    *,
    seed: int,
    wanted: Callable[[str], bool] = lambda name: True,
    init: Init | None = None,
) -> Iterator[Made]:
    """Every parameter and persistent buffer of `module` with its initial value (module doc), one
    submodule at a time, in `named_modules` order. `wanted(name)` says which a caller needs; a
    submodule none of whose own tensors is wanted is not made at all. A tied parameter is made by
    the first submodule that holds it.

    A submodule's own tensors are set by the first of `init(submodule)` (when given), Hugging
    Face's init and ``reset_parameters()`` that sets them (what is still unset is an error); then,
    as in an eager build (a child is built, and Hugging Face's ``initialize_weights`` applied,
    before its parent), each module above it, nearest first, may overwrite them: its
    ``reset_parameters()``, then Hugging Face's init, then `init`, the last word winning (GPT-2's
    ``GPT2Attention`` rescales its child ``c_proj``'s weight so)."""
    modules = dict(module.named_modules())
    shells = dict(_meta_twin(module).named_modules(remove_duplicate=False))
    seen: set[int] = set()
    tied: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for path, sub in modules.items():
        own = _own(sub, seen)
        if not own:
            continue
        full = {n: (f"{path}.{n}" if path else n) for n in own}
        if not any(wanted(alias) for n, t in own.items() for alias in tied.get(id(t), [full[n]])):
            continue
        shell = shells[path]
        try:
            values = _make(shell, sub, path, own, seed, _steps(shells, modules, path, init))
            for above in _above(path):
                steps = _steps(shells, modules, above, init)
                _overwrite(shells[above], shell, values, module_seed(seed, f"{above}|{path}"), steps)
        finally:
            _empty(shell, own)
        for n, t in own.items():
            yield Made(tuple(tied.get(id(t), [full[n]])), values[n])


def _above(path: str) -> list[str]:
    """The paths of the modules above `path`, nearest first, the root ("") last."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _own(sub: torch.nn.Module, seen: set[int]) -> dict[str, torch.Tensor]:
    """The submodule's own (not its children's) params and persistent buffers not yet made."""
    out: dict[str, torch.Tensor] = {}
    for n, p in sub._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out[n] = p
    for n, b in sub._buffers.items():
        if b is not None and n not in sub._non_persistent_buffers_set and id(b) not in seen:
            seen.add(id(b))
            out[n] = b
    return out


def _put(shell: torch.nn.Module, n: str, t: torch.Tensor) -> None:
    if n in shell._parameters:
        shell._parameters[n] = torch.nn.Parameter(t, requires_grad=shell._parameters[n].requires_grad)
    else:
        shell._buffers[n] = t


def _empty(shell: torch.nn.Module, own: dict[str, torch.Tensor]) -> None:
    """Back to meta: the shell holds no value once its submodule's are handed on."""
    for n, t in own.items():
        _put(shell, n, torch.empty_like(t, device="meta"))


def _make(
    shell: torch.nn.Module,
    sub: torch.nn.Module,
    path: str,
    own: dict[str, torch.Tensor],
    seed: int,
    steps: list[tuple[str, Init]],
) -> dict[str, torch.Tensor]:
    """`own`'s values, made in `shell` (a copy of `sub` whose other tensors, and its children's,
    are on the meta device: an init that touches them changes nothing)."""
    fills: dict[str, float | int | bool] = {}
    for n, t in own.items():
        fills[n] = sentinel(t.dtype)
        _put(shell, n, torch.full(t.shape, fills[n], dtype=t.dtype))
    done: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, path))
        for _, step in steps:
            if len(done) == len(own):
                break
            step(shell)
            for n in own:  # what an earlier init set stands: a later one only fills the rest
                if n in done:
                    _get(shell, n).copy_(done[n])
                elif not is_unset(_get(shell, n), fills[n]):
                    done[n] = _get(shell, n).detach().clone()
    unset = [n for n in own if n not in done]
    if unset:
        where = f"{path}.{unset[0]}" if path else unset[0]
        tried = ", ".join(label for label, _ in steps) or (
            "any initializer (it has no reset_parameters and no Hugging Face model above it)"
        )
        raise ModuleInitError(
            f"{where!r} of submodule {path or '<root>'!r} ({type(sub).__name__}) is not set by {tried}; "
            "give it one: init=<a function of the submodule>, or a reset_parameters() method"
        )
    for n in own:
        _put(shell, n, done[n])
    return done


def _overwrite(
    above: torch.nn.Module,
    shell: torch.nn.Module,
    values: dict[str, torch.Tensor],
    seed: int,
    steps: list[tuple[str, Init]],
) -> None:
    """Run the initializers of the module `above` (a shell whose only values are `shell`'s,
    `values`) as an eager build would after its child's: whatever they write to `values` stands."""
    if not steps:
        return
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for _, step in reversed(steps):  # the first in priority writes last
            step(above)
    for n in values:
        values[n] = _get(shell, n).detach()


# A module's own initializers, called with no argument, in the order tried: torch's convention
# (nn.Linear, nn.LayerNorm...), MultiheadAttention's, torchtitan's, and the root-level loop many
# models run at the end of __init__ (nanoGPT, our reference programs).
NO_ARG_INITS = ("reset_parameters", "_reset_parameters", "init_weights", "_init_weights")


def _steps(
    shells: dict[str, torch.nn.Module], modules: dict[str, torch.nn.Module], path: str, init: Init | None
) -> list[tuple[str, Init]]:
    """The initializers of the module at `path`, in priority order, each with the name an error
    shows: `init`, Hugging Face's init of the nearest pretrained model above, then the module's
    own (not a pretrained model's: its ``init_weights()`` would re-initialize and re-tie it all)."""
    out: list[tuple[str, Init]] = []
    if init is not None:
        out.append((f"init={getattr(init, '__name__', init)}", init))
    hf = hf_init(path, modules)
    if hf is not None:
        out.append((f"{type(hf.__self__).__name__}._init_weights(module)", hf))
    shell = shells[path]
    if not is_hf_model(modules[path]):
        for name in NO_ARG_INITS:
            f = getattr(shell, name, None)
            if callable(f) and _required_args(f) == 0:
                out.append((f"{type(shell).__name__}.{name}()", lambda m, f=f: f()))
    return out


def _required_args(f: Callable) -> int | None:
    """How many arguments `f` needs (None: it cannot be told)."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    )


def _meta_twin(m: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `m` and of its children, their tensors empty ones on the meta device."""
    twin = copy.copy(m)
    twin._parameters = {
        n: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for n, p in m._parameters.items()
    }
    twin._buffers = {
        n: None if b is None else torch.empty_like(b, device="meta") for n, b in m._buffers.items()
    }
    twin._modules = {n: None if c is None else _meta_twin(c) for n, c in m._modules.items()}
    return twin


def _get(m: torch.nn.Module, n: str) -> torch.Tensor:
    return m._parameters[n] if n in m._parameters else m._buffers[n]
