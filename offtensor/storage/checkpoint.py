"""The tensors of a safetensors checkpoint, by key, read one at a time (offtensor.load).

# Note [checkpoint keys]
A checkpoint key is a parameter's name, possibly less `.base_layer` (PEFT) and leading
components (PEFT's `base_model.model.`, an outer wrapper's attribute). Dropping a different
prefix for each parameter would let a checkpoint fill parameters it does not hold: one of a
decoder alone (`0.fc.weight`) fills `encoder.0.fc.weight` and `decoder.0.fc.weight` alike. So
the prefix the first match drops is the one every later match must drop (`Checkpoint.find`), and
a name that matches only under another prefix raises, naming both. And since `init=` fills every
parameter the checkpoint lacks, a checkpoint that matches nothing (another architecture, another
prefix) would give a randomly initialized model silently: `load` warns naming the tensors it did
not use, as `from_pretrained` reports unexpected keys.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .compress import copy_rows
from .files import FileHandle, FileStore, FileTensor, copy_from_file

_INDEX = "model.safetensors.index.json"

# safetensors' dtype names (its header's "dtype")
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class Checkpoint:
    """The tensors of a safetensors checkpoint, by key, read one at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        path = Path(path)
        self.files: dict[str, Path] = {}
        self.used: set[str] = set()  # the keys read (Note [checkpoint keys])
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}  # file -> (its data's offset, header)
        self._handles: dict[Path, FileHandle] = {}  # the files read, each opened once
        self._first: tuple[str, str, str] | None = None  # the first match: name, key, prefix dropped
        if path.is_dir() and (path / _INDEX).is_file():
            weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
            self.files = {key: path / name for key, name in weight_map.items()}
        elif path.is_dir() and (path / "model.safetensors").is_file():
            self._add_file(path / "model.safetensors")
        elif path.is_file() and path.suffix == ".safetensors":
            self._add_file(path)
        else:
            raise FileNotFoundError(
                f"offtensor.load: {str(path)!r} is not a safetensors checkpoint: expected a directory "
                f"holding {_INDEX} (sharded) or model.safetensors, or a .safetensors file")

    def _add_file(self, file: Path) -> None:
        with self._safe_open(str(file), framework="pt") as f:
            self.files.update((key, file) for key in f.keys())

    def find(self, names: list[str], *, other_prefixes: bool = True) -> str | None:
        """The checkpoint's key for a tensor known by `names` (its names in the model), dropping
        the same leading components as every earlier match (Note [checkpoint keys]).
        `other_prefixes` False: once a match set the prefix, a key under another prefix is not
        looked for (a block's `norm.running_mean` is not the final norm's)."""
        for name in names:
            for candidate in (name, name.replace(".base_layer", "")):
                parts = candidate.split(".")
                for i in range(len(parts)):
                    key = ".".join(parts[i:])
                    if key not in self.files:
                        continue
                    prefix = candidate[: len(candidate) - len(key)]
                    if not other_prefixes and self._first is not None and prefix != self._first[2]:
                        continue
                    if self._first is None:
                        self._first = (name, key, prefix)
                    elif prefix != self._first[2]:
                        first, first_key, first_prefix = self._first
                        raise ValueError(
                            f"offtensor.load: {name!r} would be read from checkpoint key {key!r}, dropping "
                            f"{prefix!r}, but {first!r} was read from key {first_key!r}, dropping "
                            f"{first_prefix!r}: a checkpoint's keys must be the model's names less one "
                            "common prefix. Is this the checkpoint of part of the model? Load that part "
                            "(offtensor.load(model.part, ...)) or rename the checkpoint's keys")
                    self.used.add(key)
                    return key
        return None

    def warn_unused(self) -> None:
        """Warn naming the tensors no parameter or buffer was read from (Note [checkpoint keys])."""
        unused = [key for key in self.files if key not in self.used]
        if unused:
            names = ", ".join(repr(k) for k in unused[:5]) + (", ..." if len(unused) > 5 else "")
            warnings.warn(
                f"offtensor.load: did not load {len(unused)} of the checkpoint's {len(self.files)} tensors "
                f"({names}): no parameter or buffer on the meta device, nor persistent buffer, has their "
                "names. Check that the checkpoint is the model's (a different architecture or prefix "
                "leaves the parameters to init=)", stacklevel=3)

    def rows(self, key: str, qual: str, like: torch.Tensor) -> _Rows:
        """A RowReader of the tensor `key`, checked against `like` (parameter `qual`)."""
        file = self.files[key]
        start, header = self._header(file)
        entry = header[key]
        if tuple(entry["shape"]) != tuple(like.shape):
            raise ValueError(_shape_error(key, tuple(entry["shape"]), qual, like))
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:  # a dtype torch lacks: safetensors converts it
            return _Rows(like, lambda: _SafeRows(self._safe_open, file, key))
        return _Rows(like, None, (self._handle(file), start + begin, end - begin, dtype))

    def in_file(self, key: str, qual: str, like: torch.Tensor, store: FileStore) -> FileTensor | _Rows:
        """Where the tensor `key` is in its file, checked against `like` (parameter `qual`), to be
        read there (Note [masters in files] in storage/file_masters.py); its RowReader for a dtype
        safetensors names that torch lacks."""
        file = self.files[key]
        start, header = self._header(file)
        entry = header[key]
        if tuple(entry["shape"]) != tuple(like.shape):
            raise ValueError(_shape_error(key, tuple(entry["shape"]), qual, like))
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            return self.rows(key, qual, like)
        begin, end = entry["data_offsets"]
        return FileTensor(store.open(file), start + begin, end - begin, dtype, lambda: self.rows(key, qual, like))

    def _header(self, file: Path) -> tuple[int, dict[str, Any]]:
        """The file's header, and where its data begins."""
        if file not in self._headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        return self._headers[file]

    def _handle(self, file: Path) -> FileHandle:
        handle = self._handles.get(file)
        if handle is None:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            handle = self._handles[file] = FileHandle(str(file), fd)
        return handle


class _SafeRows:
    """A tensor of a dtype torch lacks, read through safetensors a block of rows at a time; the
    file is open (mapped) from the first block to the last."""

    def __init__(self, safe_open: Any, file: Path, key: str) -> None:
        self._handle = safe_open(str(file), framework="pt")
        self._file = self._handle.__enter__()
        self._slice = self._file.get_slice(key)
        self._key = key

    def __call__(self, start: int, stop: int, last: bool) -> torch.Tensor:
        t = self._slice[start:stop] if self._slice.get_shape() else self._file.get_tensor(self._key)
        if last:
            self._handle.__exit__(None, None, None)
        return t


class _Rows:
    """Reads one checkpoint tensor a block of rows at a time (a RowReader, offtensor/formats.py),
    in `like`'s dtype: preads of the file, or through safetensors for a dtype torch lacks
    (`safe`). `read_into` reads the whole tensor straight into its destination when that has the
    file's dtype (Note [loading at the disk's speed])."""

    def __init__(self, like: torch.Tensor, safe: Callable[[], _SafeRows] | None,
                 where: tuple[FileHandle, int, int, torch.dtype] | None = None) -> None:
        self.dtype = like.dtype
        self.shape = tuple(like.shape)
        self.rows = like.shape[0] if like.dim() else 1
        self._safe = safe
        self._safe_rows: _SafeRows | None = None
        self._where = where

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        if self._where is None:
            if self._safe_rows is None:
                assert self._safe is not None
                self._safe_rows = self._safe()
            return self._safe_rows(start, stop, stop >= self.rows).to(self.dtype)
        handle, offset, nbytes, dtype = self._where
        shape = (stop - start, *self.shape[1:]) if self.shape else ()
        t = torch.empty(shape, dtype=dtype)
        row_bytes = nbytes // self.rows if self.shape else 0
        handle.read_into([_bytes_of(t).data], offset + start * row_bytes)
        return t.to(self.dtype)

    def read_into(self, dest: torch.Tensor) -> bool:
        """Read the whole tensor into `dest` if it is a contiguous CPU tensor of the file's dtype;
        False otherwise (then read it a block of rows at a time)."""
        if self._where is None:
            return False
        handle, offset, _, dtype = self._where
        if not (dest.device.type == "cpu" and dest.dtype == dtype == self.dtype and dest.is_contiguous()
                and tuple(dest.shape) == self.shape):
            return False
        copy_from_file(handle, offset, _bytes_of(dest))
        return True

    def read(self) -> torch.Tensor:
        """The whole tensor (small ones: buffers)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        copy_rows(out, self)
        return out


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, writable (uint8)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _shape_error(key: str, shape: tuple[int, ...], qual: str, like: torch.Tensor) -> str:
    return (f"offtensor.load: checkpoint tensor {key!r} has shape {shape}, but parameter "
            f"{qual!r} of the model has shape {tuple(like.shape)}; build the model from the "
            "checkpoint's config")
