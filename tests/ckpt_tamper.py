"""Damaged copies of a sharded checkpoint for the refusal tests (issue 47): one piece of a var
dropped, doubled (a piece added over two others) or shifted, in `.metadata` only, as a lost
worker file, a botched merge or a hand edit would leave it. Shared by the in-process tests and
the worker processes that load the copies at other degrees (tests/ is on their path)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import torch

HOWS = ("drop", "double", "shift")
KINDS = ("param", "opt_state")


def _adjacent(chunks: list, size: list[int]) -> tuple[int, int, int] | None:
    """(p, q, axis): piece q starts on `axis` where piece p ends, both alike on every other axis."""
    for a in range(len(size)):
        for p, cp in enumerate(chunks):
            for q, cq in enumerate(chunks):
                others = [d for d in range(len(size)) if d != a]
                if cq.offsets[a] == cp.offsets[a] + cp.sizes[a] and all(
                    cq.offsets[d] == cp.offsets[d] and cq.sizes[d] == cp.sizes[d] for d in others
                ):
                    return p, q, a
    return None


def expected_fault(
    size: list[int], boxes: list[tuple[list[int], list[int]]]
) -> tuple[str | None, list[int] | None]:
    """The oracle, by brute force on a count per element: the first element covered twice, else
    the first covered by none; (None, None) for an exact tiling."""
    count = torch.zeros(size, dtype=torch.int32)
    for off, sz in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(off, sz, strict=True))] += 1
    flat = count.reshape(-1)
    twice = (flat > 1).nonzero()
    never = (flat == 0).nonzero()
    if len(twice):
        what, at = "covered twice", int(twice[0])
    elif len(never):
        what, at = "uncovered", int(never[0])
    else:
        return None, None
    return what, [int(i) for i in torch.unravel_index(torch.tensor(at), tuple(size))]


def tamper(step_folder: Path, dest: Path, how: str, kind: str) -> dict:
    """Copy `step_folder` to `dest` with one piece of the first var of `kind` (most dims, then
    name) that has
    two neighbouring pieces dropped, doubled or shifted (by 5 along the axis they meet on).
    Returns the var, what is wrong and the first wrong element of its stored tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from metaopt.fleet import dcp_glue

    shutil.copytree(step_folder, dest)
    info = json.loads((dest / "metaopt.json").read_text())["vars"]
    md = dcp_glue.SafeReader(dest).read_metadata()
    # the var of most dims first: a flat-stored (ZeRO) one's element is named in its shape too
    for name in sorted(
        (n for n, i in info.items() if i["kind"] == kind), key=lambda n: (-len(info[n]["shape"]), n)
    ):
        tm = md.state_dict_metadata[name]
        found = _adjacent(tm.chunks, list(tm.size))
        if found is not None:
            break
    else:
        raise AssertionError(f"{step_folder}: no {kind} var with two neighbouring pieces")
    p, q, axis = found
    cp, cq = tm.chunks[p], tm.chunks[q]
    key = MetadataIndex(name, cp.offsets)
    if how == "drop":
        del tm.chunks[q], md.storage_data[MetadataIndex(name, cq.offsets)]
    elif how == "double":  # from the middle of p into q, its data p's blob
        offsets, sizes = list(cp.offsets), list(cp.sizes)
        offsets[axis] += cp.sizes[axis] // 2
        sizes[axis] = min(cp.sizes[axis], tm.size[axis] - offsets[axis])
        tm.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        md.storage_data[MetadataIndex(name, offsets)] = md.storage_data[key]
    else:  # shift p onto q by 5 (or q's length)
        offsets = list(cp.offsets)
        offsets[axis] += min(5, cq.sizes[axis])
        tm.chunks[p] = ChunkStorageMetadata(torch.Size(offsets), cp.sizes)
        md.storage_data[MetadataIndex(name, offsets)] = md.storage_data.pop(key)
    md.storage_meta = None
    (dest / ".metadata").write_bytes(pickle.dumps(md))
    what, index = expected_fault(list(tm.size), [(list(c.offsets), list(c.sizes)) for c in tm.chunks])
    return {"var": name, "what": what, "index": index}


def tamper_all(step_folder: Path, out: Path) -> dict[str, dict]:
    """Every (how, kind) copy of `step_folder` under `out`, by folder name; `out/cases.json`
    lists them with what each load must name."""
    out.mkdir(parents=True, exist_ok=True)
    cases = {
        f"{how}-{kind}": tamper(step_folder, out / f"{how}-{kind}", how, kind)
        for how in HOWS
        for kind in KINDS
    }
    (out / "cases.json").write_text(json.dumps(cases))
    return cases


def refusals(exe, program, out: Path) -> dict[str, str]:  # noqa: ANN001 - an Executor and a Program
    """Load every copy under `out` (every worker calls this): each refusal's text by case, or
    "LOADED" where one loaded."""
    from metaopt import fleet
    from metaopt.fleet import sharded_io

    got = {}
    for case in json.loads((out / "cases.json").read_text()):
        try:
            fleet.load_persistables(exe, out / case, program)
            got[case] = "LOADED"
        except sharded_io.CheckpointError as e:
            got[case] = str(e)
    return got


def check_refusals(got: dict[str, str], out: Path) -> None:
    """Each case was refused naming its var, what is wrong and the element."""
    cases = json.loads((out / "cases.json").read_text())
    assert set(got) == set(cases)
    for case, want in cases.items():
        text = f"var {want['var']!r}: its pieces in "
        assert text in got[case], (case, got[case][:500])
        assert f"do not tile it: element {want['index']} is {want['what']}" in got[case], (
            case,
            got[case][:500],
        )
