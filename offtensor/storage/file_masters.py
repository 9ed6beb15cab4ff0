"""Masters read from files on demand (`Policy(host_budget=...)`). The loads of their scopes go
through the staging ring (storage/staging.py, Note [staged loads]); the files themselves are
storage/files.py.

# Note [masters in files]
A model larger than host RAM can still be loaded from safetensors files: `offtensor.load` with
`Policy(host_budget=B)` keeps in RAM the scopes that fit B and leaves the masters of the other
frozen scopes in the files (`plan_host_budget`). Scopes with a trainable parameter always stay in
RAM, where the optimizer steps them; when they alone exceed B the load raises, naming the fix.
The RAM scopes are spread over wrap's order by bytes, the first one first (as the VRAM budget
spreads kept scopes, Note [VRAM budget] in budget/vram.py): while a RAM scope computes, the reads
of the file scopes after it go on, so the disk rarely idles.
A file scope's parameters hold a placeholder; each master is a `FileMaster` (a StoredMaster, as
compressed masters are, so every read through the parameter — `p.data`, `state_dict()`, an op
outside its scope, `unwrap` — reads its bytes from the file, Note [compressed masters] in
storage/compress.py). Writes raise instead (`check_write`, before anything changes): a master that lives
in a file stays as the file has it. A checkpoint tensor in the parameter's dtype is read where
the checkpoint holds it; the others (compressed by `frozen_format`, converted to the model's
dtype, filled by `init=`) are written once, at load, to a cache file beside the checkpoint
(`FileStore`, unlinked at once: it goes with the process), so a load reads each master's host
bytes as they are, whatever produced them, and a compressed scope reads its compressed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from ..formats import FrozenFormat, RowReader
from .compress import PackedMaster, copy_rows
from .files import FileHandle, FileStore, FileTensor
from .memory import HostBuffer

READ_CHUNK = 16 * 2**20  # bytes per read, so one scope's read spreads over the staging ring's readers


@dataclass(eq=False)
class FileMaster:
    """A frozen master that stays in a file, read on demand (a StoredMaster, Note [masters in
    files]); its host bytes are those a RAM master would have: compressed under `format`."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    format: FrozenFormat | None
    file: FileHandle
    offset: int
    nbytes: int

    def read(self) -> torch.Tensor:
        """The master's host bytes, read now (uint8, a new tensor)."""
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self.file.read_into([data.numpy().data], self.offset)
        return data

    def unpack(self) -> torch.Tensor:
        data = self.read()
        if self.format is None:
            return data.view(self.dtype).view(self.shape)
        return self.format.unpack(data, self.dtype, self.shape)

    def unpack_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        if self.format is not None:
            self.format.unpack_into(out, packed, self.dtype)
        else:
            out.copy_(packed[: self.nbytes].view(self.dtype).view(self.shape))

    def pack(self, value: torch.Tensor | RowReader) -> None:
        self.check_write()

    def placeholder(self) -> torch.Tensor:
        fill = float("nan") if self.dtype.is_floating_point else 0
        return torch.full((), fill, dtype=self.dtype).expand(self.shape)

    def kept_as(self) -> str:
        return (f"read on demand from {self.file.path!r} (its scope did not fit "
                "Policy(host_budget=...) in host RAM)")

    def check_write(self) -> None:
        raise RuntimeError(
            f"offtensor: cannot write parameter {self.name!r}: it is {self.kept_as()}, and its "
            "master stays as the file has it; nothing was changed. Raise Policy(host_budget=...) "
            "so that its scope fits in host RAM, or call offtensor.unwrap(model) first (it reads "
            "every master into RAM)")

    def refuse_training(self) -> NoReturn:
        raise RuntimeError(
            f"offtensor: parameter {self.name!r} is {self.kept_as()} and cannot be trained: an "
            "optimizer writes its master. Leave it trainable (requires_grad=True) when calling "
            "offtensor.load, which keeps its scope in host RAM, or raise host_budget")


class FileScope:
    """Where one scope's masters are in files, and the reads that fill a staging slot with them
    (Note [masters in files])."""

    def __init__(self, name: str, store: FileStore) -> None:
        self.name = name
        self.store = store
        # (file, offset in it, offset in the scope's host layout, bytes) per master
        self._extents: list[tuple[FileHandle, int, int, int]] = []
        self._reads: list[tuple[FileHandle, int, list[tuple[int, int]]]] | None = None

    def master(self, qual: str, p: torch.Tensor, offset: int, fmt: FrozenFormat | None,
               value: torch.Tensor | RowReader) -> FileMaster:
        """The master of parameter `qual`, at `offset` bytes of the scope's host layout, from
        `value`: read where a checkpoint holds it as the master keeps it, else written to the
        cache file (compressed under `fmt`)."""
        if isinstance(value, FileTensor) and fmt is None and value.dtype == p.dtype:
            file, at, nbytes = value.file, value.offset, value.nbytes
        else:
            data = _host_bytes(qual, p, fmt, value)
            file, at = self.store.append(data, f"parameter {qual!r}")
            nbytes = data.numel()
        self._extents.append((file, at, offset, nbytes))
        return FileMaster(qual, p.dtype, torch.Size(p.shape), fmt, file, at, nbytes)

    def reads(self) -> list[tuple[FileHandle, int, list[tuple[int, int]]]]:
        """(file, offset, [(offset in the host layout, bytes), ...]) per read: masters that follow
        each other in a file are read together, in pieces of at most READ_CHUNK bytes."""
        if self._reads is None:
            reads: list[tuple[FileHandle, int, list[tuple[int, int]]]] = []
            end: tuple[FileHandle, int] | None = None
            size = 0
            for file, at, dest, n in sorted(self._extents, key=lambda e: (id(e[0]), e[1])):
                while n:
                    if end != (file, at) or size >= READ_CHUNK:
                        reads.append((file, at, []))
                        size = 0
                    take = min(n, READ_CHUNK - size)
                    reads[-1][2].append((dest, take))
                    at, dest, n, size = at + take, dest + take, n - take, size + take
                    end = (file, at)
            self._reads = reads
        return self._reads


def _host_bytes(qual: str, p: torch.Tensor, fmt: FrozenFormat | None, value: torch.Tensor | RowReader) -> torch.Tensor:
    """The bytes a RAM master of `p` would hold (compressed under `fmt`), from `value`."""
    if fmt is not None:
        buffer = HostBuffer(fmt.nbytes(p.shape, p.dtype), pin=False)
        PackedMaster.on(buffer.tensor, 0, qual, fmt, p.dtype, p.shape).pack(value)
        return buffer.flat
    t = torch.empty(p.shape, dtype=p.dtype)
    copy_rows(t, value)
    return t.reshape(-1).view(torch.uint8)


def plan_host_budget(scopes: list[tuple[str, int, list[str]]], budget: int) -> set[str]:
    """(name, host bytes, its trainable parameters' names) per scope in wrap's order -> the names
    of the scopes whose masters stay in files (Note [masters in files])."""
    trainable = [(name, n, names) for name, n, names in scopes if names]
    needed = sum(n for _, n, _ in trainable)
    if needed > budget:
        first = trainable[0][2][0]
        # Exact bytes: the scopes' host layouts are padded (ALIGN), so no figure computed from
        # the parameters, nor a rounded one, is what makes the same load succeed.
        raise ValueError(
            f"offtensor.load: the scopes with trainable offloaded parameters take {needed} bytes "
            f"({_readable(needed)}) of host RAM ({len(trainable)} scopes, e.g. parameter {first!r}), more "
            f"than Policy(host_budget={budget}): trainable masters stay in host RAM, where the "
            f"optimizer steps them. Raise host_budget to at least {needed}, freeze what you do not "
            "train before offtensor.load (requires_grad_(False)), or keep the trainable parameters "
            "on the device with Policy(param_filter=offtensor.frozen_only)")
    room = budget - needed
    frozen = [(name, n) for name, n, names in scopes if not names]
    if sum(n for _, n in frozen) <= room:
        return set()
    in_ram: set[str] = set()
    rest = frozen
    if frozen[0][1] <= room:
        in_ram.add(frozen[0][0])
        room -= frozen[0][1]
        rest = frozen[1:]
    # The rest spread evenly by bytes: each scope earns the RAM share (room / rest) of its bytes,
    # and one stays in RAM when the earnings so far pay for it (in integers: x rest).
    rest_bytes = max(1, sum(n for _, n in rest))
    share, credit = room, 0
    for name, n in rest:
        credit += share * n
        if n * rest_bytes <= credit and n <= room:
            in_ram.add(name)
            room -= n
            credit -= n * rest_bytes
    return {name for name, _ in frozen if name not in in_ram}


def _readable(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
