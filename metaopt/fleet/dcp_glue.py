"""The parts of sharded checkpoints that subclass or build ``torch.distributed.checkpoint``'s
own types (metaopt.fleet.sharded_io has the protocol). They live apart because importing DCP
takes about a second (it imports DTensor and sympy): sharded_io imports this module only when a
multi-worker save or load runs, not in every worker that never checkpoints."""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _create_file_view, _StorageInfo
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from metaopt.fleet.sharded_io import CheckpointError
from metaopt.ir import Split, ZeroShard


class Pieces:
    """One worker's part of a var as DCP sees it: the pieces of the full tensor it holds, each
    a view of the local tensor at its offset in the full one (several for a fused projection cut
    per block). DCP takes any object with these three methods (its ``_Checkpointable`` protocol,
    the one DTensor implements); the planners below hand DCP the piece at an offset. Loading
    writes through the views into `local`. `of_split` (tensor parallel) and `of_zero` (ZeRO's flat
    slices) build one."""

    def __init__(self, local: torch.Tensor, full: torch.Size, parts: dict[torch.Size, torch.Tensor]) -> None:
        self.local = local
        self.full = full
        self.parts = parts

    @classmethod
    def of_split(cls, local: torch.Tensor, split: Split, index: int) -> Pieces:
        split.require_model()
        parts: dict[torch.Size, torch.Tensor] = {}
        for full_at, local_at, n in split.pieces(index):
            offsets = [0] * local.dim()
            offsets[split.axis] = full_at
            parts[torch.Size(offsets)] = local.narrow(split.axis, local_at, n)
        return cls(local, torch.Size(split.full_shape(tuple(local.shape))), parts)

    @classmethod
    def of_zero(cls, local: torch.Tensor, zero: ZeroShard, index: int) -> Pieces:
        """Part `index` of a ZeRO-sharded var: the full tensor is stored flat (1-D, its padding
        left out), this worker's elements one chunk of it (none when it holds padding only)."""
        start, n = zero.piece(index)
        parts = {torch.Size([start]): local[:n]} if n else {}
        return cls(local, torch.Size([zero.full_numel]), parts)

    @classmethod
    def of_zero_split(
        cls, local: torch.Tensor, zero: ZeroShard, index: int, split: Split, mp_index: int
    ) -> Pieces:
        """Part `index` of the ZeRO slices of this worker's tensor-parallel part (sharding beside
        tensor parallel): its flat elements are a run of the part `split` places at `mp_index`,
        stored as the boxes of the full tensor (n-d, not flat) that run covers: a partial row, whole
        rows, a partial row, at each depth, each box cut where the split's blocks end."""
        split.require_model()
        start, n = zero.piece(index)
        parts: dict[torch.Size, torch.Tensor] = {}
        for offsets, sizes, at in flat_boxes(zero.full, start, start + n):
            box = local[at - start : at - start + math.prod(sizes)].view(sizes)
            a, length = offsets[split.axis], sizes[split.axis]
            for full_at, local_at, m in split.pieces(mp_index):  # the box's rows in each block
                lo, hi = max(a, local_at), min(a + length, local_at + m)
                if lo < hi:
                    off = list(offsets)
                    off[split.axis] = full_at + lo - local_at
                    parts[torch.Size(off)] = box.narrow(split.axis, lo - a, hi - lo)
        return cls(local, torch.Size(split.full_shape(zero.full)), parts)

    def size(self) -> torch.Size:  # DCP compares it with the saved full size before loading
        return self.full

    def piece(self, offset: Any) -> torch.Tensor:
        return self.parts[torch.Size(offset)]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=dcp_meta.MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=dcp_meta.ChunkStorageMetadata(offsets=off, sizes=t.size()),
                    properties=dcp_meta.TensorProperties.create_from_tensor(t),
                    size=self.full,
                ),
            )
            for off, t in self.parts.items()
        ]

    def __create_chunk_list__(self) -> list[dcp_meta.ChunkStorageMetadata]:
        return [dcp_meta.ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.parts.items()]

    def __get_tensor_shard__(self, index: dcp_meta.MetadataIndex) -> torch.Tensor:
        return self.piece(index.offset)


def flat_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The elements [start, stop) of a row-major tensor of `shape` as boxes: (offsets, sizes, flat
    index of the box's first element), in order, each box's elements a contiguous run."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    (r0, o0), (r1, o1) = divmod(start, inner), divmod(stop, inner)

    def row(r: int, a: int, b: int) -> list:
        return [((r, *off), (1, *sz), r * inner + at) for off, sz, at in flat_boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, o0, o1)
    out = []
    if o0:
        out += row(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if o1:
        out += row(r1, 0, o1)
    return out


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view of a larger storage: ``torch.save`` (DCP's writer)
    writes a view's whole storage. Called per item as DCP writes it: one piece copied at a time."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: dcp_meta.MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return _own_storage(obj.piece(index.offset))
        found = super().lookup_object(index)
        return _own_storage(found) if isinstance(found, torch.Tensor) else found


class LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # DCP's set-up walks the state dict in place and replaces every object it does not know
        # (ours) with None; keep the pieces out of its walk (the state dict is flat already).
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in pieces}, *args, **kwargs)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: dcp_meta.MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.piece(index.offset)
        return super().lookup_tensor(index)


# --- reading DCP's metadata without running code ---------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


# The classes whose instances a metadata pickle may fill in (pickle's BUILD opcode). BUILD on
# anything else is refused: on an allowed *class* object it would set class attributes (a
# crafted `.metadata` replaced `pathlib.PosixPath.is_file`, which made every path look inside
# the folder, for the rest of the process).
_BUILDABLE = (
    dcp_meta.Metadata,
    dcp_meta.TensorStorageMetadata,
    dcp_meta.BytesStorageMetadata,
    dcp_meta.ChunkStorageMetadata,
    dcp_meta.TensorProperties,
    dcp_meta.StorageMeta,
    dcp_meta.MetadataIndex,
    _StorageInfo,
)


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler (its opcodes can be overridden, the C one's cannot; a
    `.metadata` is a few kB) with globals from `_ALLOWED` only and BUILD on `_BUILDABLE`
    instances only. torch's weights_only unpickler would be the natural choice, but it reads
    pickle protocol 2 and DCP writes protocol 5 (FRAME, SHORT_BINUNICODE)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a checkpoint's metadata")

    def load_build(self) -> None:
        inst = self.stack[-2] if len(self.stack) >= 2 else None
        if type(inst) not in _BUILDABLE:
            what = f"class {inst.__name__}" if isinstance(inst, type) else type(inst).__name__
            raise pickle.UnpicklingError(f"refused to set the state of {what} in a checkpoint's metadata")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` through an allow-list, refusing one larger than
    `max_bytes` unread and any storage path that leaves the folder. Given `metadata` (read and
    checked already), it hands that on instead of unpickling the file again."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        metadata: dcp_meta.Metadata | None = None,
    ) -> None:
        super().__init__(path)
        self._folder = Path(os.fspath(path)).resolve()
        self._max_bytes = max_bytes
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        if self._checked is not None:
            self._checked.storage_meta.load_id = self.load_id
            return self._checked
        path = self._folder / ".metadata"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self._max_bytes is not None and size > self._max_bytes:
                    raise CheckpointError(
                        f"{path} is {size} bytes, more than the {self._max_bytes} its checkpoint's "
                        "vars and workers can need: refused unread"
                    )
                md = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(
                f"{self._folder} has no DCP metadata (.metadata): not a complete checkpoint"
            ) from None
        except CheckpointError:
            raise
        except Exception as e:  # any unpickling failure: not a checkpoint we can trust
            raise CheckpointError(f"{path} is not readable DCP metadata ({type(e).__name__}: {e})") from None
        if not isinstance(md, dcp_meta.Metadata) or not isinstance(md.state_dict_metadata, dict):
            raise CheckpointError(f"{path} is not DCP metadata")
        for index, where in (md.storage_data or {}).items():
            fqn = getattr(index, "fqn", index)
            rel = getattr(where, "relative_path", None)
            if type(rel) is str and "\0" in rel:  # os.path would raise a raw ValueError on it
                raise CheckpointError(f"{path}: {fqn!r}'s storage path {rel!r} holds a NUL byte")
            if type(rel) is not str or not self._inside(rel):
                raise CheckpointError(f"{path}: {fqn!r} points outside the folder ({rel!r})")
            if getattr(where, "transform_descriptors", None):
                # DCP would decompress such a storage whole, unbounded (metaopt writes none).
                raise CheckpointError(
                    f"{path}: {fqn!r} is stored with transforms {where.transform_descriptors!r}: "
                    "compressed or transformed storage is refused"
                )
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_meta.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: dcp_meta.Metadata, is_coordinator: bool, *args: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args)
        self._md = metadata

    def read_data(self, plan: LoadPlan, planner: DefaultLoadPlanner) -> Future[None]:
        """DCP's read loop, with every stored tensor checked against what the metadata declares
        before it is copied: DCP's own ``copy_`` casts another dtype silently and narrows a
        larger tensor to the requested piece (a float64, bf16 or int64 shard, or a [128] one
        for a [4, 32] chunk, loaded without a word). Reads stay inside the declared slice."""
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            path = self._folder / rel
            try:
                size = os.stat(path).st_size
            except OSError as e:  # checked at the metadata read: gone since
                raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
            with open(path, "rb") as stream:
                for req in reqs:
                    where = self.storage_data[req.storage_index]
                    if where.offset < 0 or where.length < 0 or where.offset + where.length > size:
                        raise CheckpointError(
                            f"{path}: {req.storage_index.fqn!r} is declared at bytes {where.offset}.."
                            f"{where.offset + where.length} of a {size}-byte file"
                        )
                    view = _create_file_view(stream, where.offset, where.length)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(view.read(where.length)))
                        continue
                    self._load_tensor(req, view, planner, path)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _load_tensor(self, req: ReadItem, view: Any, planner: DefaultLoadPlanner, path: Path) -> None:
        fqn = req.storage_index.fqn
        tmd = self._md.state_dict_metadata[fqn]
        offset = tuple(req.storage_index.offset)
        chunk = next((c for c in tmd.chunks if tuple(c.offsets) == offset), None)
        if chunk is None:
            raise CheckpointError(f"{path}: {fqn!r} has no chunk at {list(offset)} in the metadata")
        try:
            stored = torch.load(view, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{path}: {fqn!r} is not a readable tensor ({type(e).__name__})") from None
        if not isinstance(stored, torch.Tensor):
            raise CheckpointError(f"{path}: {fqn!r} holds a {type(stored).__name__}, not a tensor")
        declared = (tmd.properties.dtype, list(chunk.sizes))
        if (stored.dtype, list(stored.shape)) != declared:
            raise CheckpointError(
                f"{path}: {fqn!r} at {list(offset)} holds {stored.dtype} {list(stored.shape)} where the "
                f"metadata declares {declared[0]} {declared[1]}"
            )
        piece = stored
        for axis, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            piece = piece.narrow(axis, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.shape != piece.shape or target.dtype != piece.dtype:
            raise CheckpointError(
                f"{path}: {fqn!r}'s piece is {piece.dtype} {list(piece.shape)}, the var's is "
                f"{target.dtype} {list(target.shape)}"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)

    def _inside(self, rel: str) -> bool:
        # Plain strings and os.path: nothing a pickle could have given methods to.
        folder = os.path.realpath(os.fspath(self._folder))
        target = os.path.realpath(os.path.join(folder, rel))
        return os.path.dirname(target) == folder and os.path.isfile(target)
