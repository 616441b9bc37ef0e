"""One export per model per test session, shared by every process of the session.

A torch export takes seconds (4-5 s for a tiny gpt on the 2-core CI machine), and the
multi-process tests start dozens of workers that each exported the same tiny models. Here the
first process to ask for a model exports it and saves the program as ONNX; every process,
the first included, then gets `metaopt.load` of that file. A saved forward program loads back
exactly as exported: the same printed program, modules, values and dtypes
(tests/frontend/test_export_cache.py checks that on the reference programs).

The cache is a folder named by `METAOPT_TEST_EXPORT_CACHE`, which tests/conftest.py sets for the
session (and removes at its end); worker processes inherit it. Without the variable, `export` is
`metaopt.export`. Use it where the subject under test is what runs after the export (workers,
references), never in tests of the exporter itself.

The key is a digest of everything that decides the program: the module's class, its printed
structure, every submodule's plain attributes (flags that `repr` may not show), the name, shape,
dtype and bytes of every parameter and buffer, the example inputs, and the export's options.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

import metaopt
from metaopt.frontend import torch_export

ENV = "METAOPT_TEST_EXPORT_CACHE"
_PLAIN = (bool, int, float, str, type(None))


def export(module: torch.nn.Module, *args: Any, **kwargs: Any) -> metaopt.Program:
    """`metaopt.export(module, *args, **kwargs)`, once per session: its arguments, defaults
    included, are the ones the key digests."""
    if not os.environ.get(ENV):
        return metaopt.export(module, *args, **kwargs)
    bound = inspect.signature(torch_export.export).bind(module, *args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    options = {k: v for k, v in given.items() if k not in ("module", "args", "kwargs")}
    path = Path(os.environ[ENV]) / f"{_key(module, given['args'], given['kwargs'], options)}.onnx"
    with _locked(path.with_suffix(".lock")):
        if not path.exists():
            _save_checked(metaopt.export(module, *args, **kwargs), path)
    names = _meta_names(path)
    return metaopt.load(path) if names is None else _on_meta(metaopt.load(path), names)


def _on_meta(program: metaopt.Program, names: list[str]) -> metaopt.Program:
    """A meta export's program as loaded: the values that were on the meta device (`names`,
    saved as zeros) back on it; the rest (the export's own constants) as saved."""
    meta = set(names)
    program.values = {
        k: torch.empty_like(v, device="meta") if k in meta else v for k, v in program.values.items()
    }
    return program


def _meta_names(path: Path) -> list[str] | None:
    """The meta values of the program saved at `path` (None: a program with values)."""
    names = path.with_suffix(".meta.json")
    return json.loads(names.read_text()) if names.exists() else None


def _save_checked(program: metaopt.Program, path: Path) -> None:
    """Save, then keep the file only if it loads back as `program`: a difference is a bug of
    save or load, reported here rather than tested around. A meta export's values on the meta
    device (nothing to save) are saved as zeros of their shapes and dtypes and their names beside
    the file, so the load puts them back on meta: the workers' meta exports (4-8 s each) shared too."""
    from metaopt.frontend.onnx_save import save

    tmp = path.with_suffix(f".{os.getpid()}.onnx")
    names = [k for k, v in program.values.items() if v.is_meta]
    if names:
        values = program.values
        program.values = {
            k: torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v for k, v in values.items()
        }
        try:
            save(program, tmp)
        finally:
            program.values = values
    else:
        save(program, tmp)
    got = metaopt.load(tmp)
    problem = differences(_on_meta(got, names) if names else got, program)
    if problem:
        tmp.unlink()
        raise AssertionError(f"{program.name!r} does not load back as exported: {problem}")
    if names:  # before the program's file: its presence says the entry is whole
        path.with_suffix(".meta.json").write_text(json.dumps(names))
    os.replace(tmp, path)


def differences(got: metaopt.Program, want: metaopt.Program) -> str | None:
    """What differs between two programs (printed form, fields, values), or None."""
    if str(got) != str(want):
        diff = difflib.unified_diff(str(want).splitlines(), str(got).splitlines(), "exported", "loaded", n=1)
        return "\n" + "\n".join(list(diff)[:40])
    for field in ("name", "inputs", "outputs", "loss_name", "modules", "updates", "donated", "derived"):
        if getattr(got, field) != getattr(want, field):
            return f"{field}: {getattr(got, field)!r} != {getattr(want, field)!r}"
    if set(got.values) != set(want.values):
        return f"values named {sorted(set(got.values) ^ set(want.values))[:5]} in only one"
    for name, t in want.values.items():
        g = got.values[name]
        same = g.shape == t.shape and g.is_meta if t.is_meta else torch.equal(g, t)
        if g.dtype != t.dtype or not same:
            return f"value {name!r}"
    return None


@contextlib.contextmanager
def _locked(lock: Path):
    """One exporter per key at a time: the others wait for its file instead of exporting too."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _key(module: torch.nn.Module, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            h.update(part if isinstance(part, bytes) else repr(part).encode())
            h.update(b"\0")

    def tensor(t: torch.Tensor) -> None:
        add(tuple(t.shape), t.dtype, t.requires_grad)
        if t.is_meta:  # no values: the shape and dtype decide the program
            add(b"meta")
        else:
            add(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    add(type(module).__module__, type(module).__qualname__, str(module), sorted(options.items()))
    for path, sub in module.named_modules():
        plain = sorted((k, v) for k, v in vars(sub).items() if isinstance(v, _PLAIN) and k[0] != "_")
        add(path, type(sub).__qualname__, plain)
    for key, t in [*module.named_parameters(), *module.named_buffers()]:
        add(key)
        tensor(t)
    for value in [*(args if isinstance(args, tuple) else (args,)), *sorted((kwargs or {}).items())]:
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            add(value[0])
            value = value[1]
        if isinstance(value, torch.Tensor):
            tensor(value)
        else:
            add(value)
    return h.hexdigest()[:32]
