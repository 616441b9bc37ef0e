"""Reads the golden text format back into a Program (exact inverse of `printer`)."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from metaopt.ir.printer import RESERVED_WORDS
from metaopt.ir.program import (
    GradientMergeInfo,
    Op,
    PipelineInfo,
    Program,
    Split,
    Var,
    ZeroShard,
    torch_dtype,
)


class ParseError(ValueError):
    def __init__(self, lineno: int, line: str, msg: str) -> None:
        super().__init__(f"line {lineno}: {msg}\n  {line.strip()}")


_TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<num>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?|\d+|inf)
                (?![A-Za-z0-9_.@/*+\-]))
      | (?P<name>[A-Za-z0-9_.@/*+\-]+|~)
      | (?P<punct><-|[()\[\],=:?])
    )""",
    re.VERBOSE,
)


class _Tokens:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN_RE.match(text, pos)
            if not m or m.end() == pos:
                raise ValueError(f"unexpected character at column {pos + 1}: {text[pos : pos + 10]!r}")
            kind = m.lastgroup
            assert kind is not None
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def next(self) -> tuple[str, str]:
        t = self.peek()
        if t is None:
            raise ValueError("unexpected end of line")
        self.i += 1
        return t

    def expect(self, value: str) -> None:
        t = self.next()
        if t[1] != value:
            raise ValueError(f"expected {value!r}, found {t[1]!r}")

    def at(self, value: str) -> bool:
        t = self.peek()
        return t is not None and t[0] == "punct" and t[1] == value

    def done(self) -> bool:
        return self.i >= len(self.toks)


def _name(tok: tuple[str, str]) -> str:
    kind, text = tok
    if kind == "str":
        return json.loads(text)
    if kind == "name":
        return "" if text == "~" else text
    if kind == "num":  # names like "0" or "3" (Sequential children) tokenize as numbers
        return text
    raise ValueError(f"expected a name, found {text!r}")


def _number(text: str) -> int | float:
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    return float(text)


def _value(t: _Tokens) -> Any:
    kind, text = t.next()
    if kind == "str":
        return json.loads(text)
    if kind == "num":
        return _number(text)
    if kind == "punct" and text == "[":
        items = []
        while not t.at("]"):
            items.append(_value(t))
            if not t.at("]"):
                t.expect(",")
        t.next()
        return items
    if kind == "name":
        if text in ("True", "False"):
            return text == "True"
        if text == "None":
            return None
        if text == "nan":
            return float("nan")
        if text == "-inf":
            return float("-inf")
        if text == "tensor":
            t.expect("(")
            dtype = torch_dtype(_name(t.next()))
            t.expect(",")
            shape = _value(t)
            t.expect(",")
            flat = _value(t)
            t.expect(")")
            return torch.tensor(flat, dtype=dtype).reshape(shape)
        if text not in RESERVED_WORDS:
            return text
    raise ValueError(f"expected a value, found {text!r}")


def _shape(t: _Tokens) -> tuple | None:
    t.expect("[")
    if t.at("?"):
        t.next()
        t.expect("]")
        return None
    dims: list[int | str] = []
    while not t.at("]"):
        kind, text = t.next()
        dims.append(int(text) if kind == "num" else json.loads(text) if kind == "str" else text)
        if not t.at("]"):
            t.expect(",")
    t.next()
    return tuple(dims)


def _parse_var(text: str) -> tuple[Var, torch.Tensor | None]:
    t = _Tokens(text)
    name = _name(t.next())
    t.expect(":")
    dtype = _name(t.next())
    shape = _shape(t)
    kind, trainable, value = "activation", False, None
    if not t.done() and not t.at("=") and not _at_layout(t) and t.peek() != ("name", "on"):
        kind = _name(t.next())
        trainable = kind == "param"
        if t.peek() == ("name", "frozen"):
            t.next()
            trainable = False
    split = _split(t) if _at_layout(t, "split") else None
    zero = _zero(t) if _at_layout(t, "zero_shard") else None
    host = t.peek() == ("name", "host")
    if host:
        t.next()
    device = None
    if t.peek() == ("name", "on"):
        t.next()
        device = _name(t.next())
    if t.at("="):
        t.next()
        value = torch.tensor(_value(t), dtype=torch_dtype(dtype))
        if shape is not None and all(isinstance(d, int) for d in shape):
            value = value.reshape(shape)  # keeps zero-size dims ("= []" of a [0,3] constant)
    if not t.done():
        raise ValueError(f"unexpected {t.peek()[1]!r}")  # type: ignore[index]
    return Var(
        name, dtype, shape, kind=kind, trainable=trainable, split=split, device=device, zero=zero, host=host
    ), value


def _at_layout(t: _Tokens, *which: str) -> bool:
    """At ``split(`` or ``zero_shard(`` (or only the `which` given)."""
    at = t.peek()
    return (
        at is not None
        and at[0] == "name"
        and at[1] in (which or _LAYOUT_KEYS)
        and t.i + 1 < len(t.toks)
        and t.toks[t.i + 1] == ("punct", "(")
    )


_LAYOUT_KEYS = {"split": ("axis", "parts", "blocks"), "zero_shard": ("parts", "full")}
_LAYOUT_OPTIONAL = {"split": ("group",), "zero_shard": ()}


def _layout_args(t: _Tokens) -> dict[str, Any]:
    """``name(key=value, ...)`` of a var layout: each of its keys once, in any order, every
    list value a list."""
    what = _name(t.next())
    keys = _LAYOUT_KEYS[what]
    t.expect("(")
    kv: dict[str, Any] = {}
    while not t.at(")"):
        key = _name(t.next())
        t.expect("=")
        if key in kv or key not in keys + _LAYOUT_OPTIONAL[what]:
            known = ", ".join(keys + _LAYOUT_OPTIONAL[what])
            raise ValueError(f"{what}: unexpected key {key!r} ({known}, once each)")
        kv[key] = _value(t)
        if not t.at(")"):
            t.expect(",")
    t.next()
    if any(k not in kv for k in keys) or not isinstance(kv[keys[-1]], list):
        raise ValueError(f"{what} needs {'=, '.join(keys)}=[...], got {sorted(kv)}")
    return kv


def _split(t: _Tokens) -> Split:
    """``split(axis=0, parts=2, blocks=[96])``, or with ``group="expert"`` (`Split.group`)."""
    kv = _layout_args(t)
    return Split(kv["axis"], kv["parts"], tuple(kv["blocks"]), kv.get("group", "model"))


def _zero(t: _Tokens) -> ZeroShard:
    """``zero_shard(parts=2, full=[16, 32])``."""
    kv = _layout_args(t)
    return ZeroShard(kv["parts"], tuple(kv["full"]))


def _split_comment(text: str) -> tuple[str, str]:
    """Code and comment of an op line: the first "  # " outside a quoted name."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif text.startswith("  # ", i):
            return text[:i], text[i + 4 :]
    return text, ""


def _parse_op(text: str) -> Op:
    code, comment = _split_comment(text)
    t = _Tokens(code)
    outputs: list[str] = []
    # Outputs precede "=", the call follows; a call with no outputs starts at its type.
    if any(tok == ("punct", "=") for tok in t.toks[: _call_start(t)]):
        while not t.at("="):
            outputs.append(_name(t.next()))
            if t.at(","):
                t.next()
        t.next()
    op_type = t.next()[1]
    t.expect("(")
    inputs: list[str] = []
    attrs: dict[str, Any] = {}
    while not t.at(")"):
        tok = t.next()
        if t.at("="):
            t.next()
            attrs[tok[1]] = _value(t)
        else:
            if attrs:
                raise ValueError("positional input after an attribute")
            inputs.append(_name(tok))
        if not t.at(")"):
            t.expect(",")
    t.next()
    if not t.done():
        raise ValueError(f"unexpected {t.peek()[1]!r} after the call")  # type: ignore[index]
    fields = _fields(comment)
    return Op(
        op_type,
        inputs,
        outputs,
        attrs,
        role=fields.get("role", "forward"),
        stage=int(fields["stage"]) if "stage" in fields else None,
        scope=fields.get("scope", ""),
        origin=fields.get("origin"),
    )


def _call_start(t: _Tokens) -> int:
    for i, tok in enumerate(t.toks):
        if tok == ("punct", "("):
            return i
    raise ValueError("no call found")


def _fields(comment: str) -> dict[str, str]:
    out: dict[str, str] = {}
    t = _Tokens(comment)
    while not t.done():
        key = _name(t.next())
        t.expect("=")
        out[key] = _name(t.next())
    return out


def _names(text: str) -> list[str]:
    t = _Tokens(text)
    out = []
    while not t.done():
        out.append(_name(t.next()))
        if not t.done():
            t.expect(",")
    return out


def parse_program(text: str) -> Program:
    """Parse the golden text format; errors name the line number and the line."""
    p = Program()
    section = None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            if not line.startswith("  "):
                head, _, rest = line.partition(":")
                if line.startswith("program "):
                    p.name = _name(_Tokens(line[len("program ") :]).next())
                elif head in ("inputs", "outputs"):
                    setattr(p, head, _names(rest))
                elif head == "loss":
                    p.loss_name = _names(rest)[0]
                elif head == "pipeline":
                    p.pipeline = PipelineInfo.parse(rest)
                elif head == "gradient_merge":
                    p.gradient_merge = GradientMergeInfo.parse(rest)
                elif head in ("vars", "modules", "updates", "ops") and not rest.strip():
                    section = head
                else:
                    raise ValueError("unknown header")
            elif section == "vars":
                var, value = _parse_var(line.strip())
                p.add_var(var, value)
            elif section == "modules":
                t = _Tokens(line.strip())
                mod = _name(t.next())
                t.expect(":")
                outs = []
                while not t.done():
                    outs.append(_name(t.next()))
                    if not t.done():
                        t.expect(",")
                p.modules[mod] = outs
            elif section == "updates":
                t = _Tokens(line.strip())
                target = _name(t.next())
                t.expect("<-")
                p.updates[target] = _name(t.next())
            elif section == "ops":
                p.ops.append(_parse_op(line.strip()))
            else:
                raise ValueError("indented line outside a section")
        except (ValueError, KeyError, IndexError) as e:
            raise ParseError(lineno, line, str(e)) from e
    return p
