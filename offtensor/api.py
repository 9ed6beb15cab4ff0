"""User-facing option and report types."""

from __future__ import annotations

import decimal
import enum
import math
import numbers
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from .formats import describe_frozen_formats, frozen_format_names


class ScopeState(enum.Enum):
    """Where a scope's parameters are: on the host only, on their way to the device, or on both
    (`summary()`'s state column)."""

    OFFLOADED = "offloaded"  # host master only; the device storage has size 0
    LOADING = "loading"  # host-to-device copy enqueued; compute has not waited for it yet
    RESIDENT = "resident"  # compute stream waited on weights_ready; device copy usable


class Residency(enum.Enum):
    """How long a scope's device copy outlives its calls under `Policy(vram_budget=...)`, beside
    its ScopeState. KEPT is chosen by the budget's layout; STREAMED and CARRIED alternate for the
    other scopes. Without a budget every scope streams."""

    STREAMED = "streamed"  # loaded for its calls, released when they end
    KEPT = "kept"  # resident by Policy.vram_budget: only a forced release offloads it
    CARRIED = "carried"  # streamed, left resident by a pass's end for the next forward; any release ends it


class MasterHome(enum.Enum):
    """Where a scope's masters live on the host and how a load reads them, beside its
    ScopeState (`summary()`'s masters column)."""

    PINNED = "pinned"  # page-locked RAM, copied to the device directly
    PAGEABLE = "pageable"  # pageable RAM, copied directly (Policy(pin_memory=False))
    RING = "ring"  # pageable RAM, staged through the page-locked staging ring
    FILE = "file"  # in a checkpoint or cache file, read into the staging ring (Policy.host_budget)


@dataclass(frozen=True)
class Policy:
    """Options for `offtensor.wrap`, passed through whole.

    Sizes (`max_scope_bytes`, `vram_budget`, `host_budget`, `expert_cache`) are bytes, written as an int, a float
    (`1.5e9`) or a string with a unit, as accelerate's `max_memory` takes them: `"16GiB"`,
    `"16GB"`, `"512 MiB"`, `"1.5GiB"` (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB
    powers of 1024; any case). The policy holds them as ints (`Policy(host_budget="1KiB")
    .host_budget == 1024`).

    Attributes:
        prefetch: how much is kept in flight on the copy stream beyond the scope computing
            (forward order in forward, the learned backward order in backward), in blocks: the
            next scopes are loaded while their bytes fit in `prefetch` times the largest
            selected module's. 1 is double buffering, 0 loads each scope when it is needed.
            Model-wide: taken from the policy given to `wrap`.
        max_scope_bytes: split a selected module whose parameters take more than this many
            bytes into one scope per child module (recursively; the module's own direct
            parameters form a scope of their own). Smaller scopes lower peak device memory
            (the scope computing is smaller; the prefetch budget stays `prefetch` whole
            modules) at the cost of more, smaller copies and hooks. `None`: a selected module is
            one scope whatever its size.
        keep_for_backward: keep this scope resident from its forward until its backward has
            run (no release and reload in between). Costs device memory for the scope during
            the whole forward, saves one host-to-device copy per step. Useful for the last
            blocks of a model in training; ignored under `torch.no_grad()`.
        pin_memory: page-lock the host masters and grads. `None` pins when the compute device is
            CUDA. Without pinning, host-to-device copies are synchronous and several times
            slower. `"ring"`: masters and grads stay pageable, and each load is copied through
            a small page-locked ring of `2 + prefetch` slots of the largest scope, so page-locked
            memory stays bounded by the ring (WSL, Windows, a low `ulimit -l`). When pinning
            fails (`None` or `True`), the scopes not pinned yet take the ring, with one warning.
            Model-wide: taken from the policy given to `wrap`.
        param_filter: `param_filter(qualified_name, param) -> bool` picks which parameters of a
            selected module are offloaded; the others stay ordinary parameters that you place
            (`model.to(device)`). `offtensor.frozen_only` offloads the frozen base weights of a
            LoRA/PEFT model and leaves the small trainable adapters on the device. `None`
            offloads all.
        compute_dtype: dtype of the device copy of floating-point parameters, e.g.
            `torch.bfloat16` with fp32 masters: the masters, their `.grad` and the optimizer
            state stay fp32 on the host, the device computes in `compute_dtype` (use activations
            of that dtype or `torch.autocast`). `None`: the masters' dtype.
        cast: where masters are cast to `compute_dtype` (see docs/design.md for measurements).
            `"device"`: the master bytes cross PCIe and are cast on the GPU (always exact, but
            fp32 moves twice the bytes of bf16). `"host"`: a host copy in `compute_dtype` is
            kept, refreshed on the CPU when the masters change; half the PCIe bytes, plus a CPU
            cast after each optimizer step. A write that bypasses the parameter
            (`p.data.add_()`, `p.detach().mul_()`) is seen at the next load, which re-casts.
        vram_budget: device bytes the scopes' weights may take together. Streaming needs room
            for 2 + `prefetch` of the largest blocks (the one computing, the one before it still
            finishing its backward, `prefetch` in flight); the scopes whose weights fit in the
            rest are kept resident (`layout` chooses which): in inference they load once; in
            training, once per optimizer step (the step changes their masters, so it frees their
            copies and the next forward loads them again) instead of in forward and again in
            backward. A backward, or a forward that no backward follows (inference), also leaves
            the streamed scopes the next forward starts with resident, as many as fit in the
            streaming room less one block ("carried"). `summary()` marks kept
            and carried scopes. Gradients on their way to the host and activations come on top.
            `"auto"`: the budget is the streaming room alone until the second pass has been
            measured; when the third starts, it grows by the device memory the measured step
            left unused at its peak (free, plus cached by PyTorch's allocator, less the peak
            allocated), less a margin (5% of the device's memory, at least 512 MiB), and the
            timed layout chooses what to keep. On a CPU compute device there is no device memory
            to measure, so the budget stays the streaming room: `"auto"` keeps nothing there
            unless every scope fits in that room (give a size to keep scopes on the CPU). `None`:
            every scope streams. A budget does not combine with
            `backward_and_step(device_share=...)`. Model-wide: taken from the policy given to
            `wrap`.
        layout: how the VRAM budget chooses what to keep. `"timed"`: from the second pass's
            measured compute per scope and the link's bandwidth, the set whose simulated step
            is shortest (copies on one link, each scope computing once its copy has landed),
            chosen when the third pass starts; `summary()` shows its predicted step. `"spread"`:
            by bytes, spread evenly over the order, from the first pass. `"auto"` (default):
            `"timed"` on CUDA, `"spread"` on a CPU compute device (nothing overlaps there, so
            timing has nothing to win). `vram_budget="auto"` always uses the timed layout.
        frozen_format: the name of a registered frozen format, `"fp8"` (float8 e4m3) or `"int8"`
            built in (Note [frozen formats] in formats.py): keep frozen offloaded parameters
            (requires_grad False at wrap: a LoRA base, every weight of a model for inference)
            compressed on the host (the built-in formats: one byte per element plus one scale
            per output row), and dequantize them on the device into the compute dtype as they
            load: host RAM and PCIe bytes about halve (from bf16). Matrices only; 1-D parameters (norms, biases)
            and small tensors stay as they are. Lossy: the compressed values become the
            parameter's values (`p`, `state_dict()` report them); writes through the parameter
            requantize, and unfreezing it raises. Not combinable with `cast="host"`. `None`: masters keep their dtype.
        host_budget: bytes of host RAM the offloaded masters may take, for `offtensor.load`
            from safetensors files. Scopes with a trainable parameter stay in RAM (an error says
            so when they do not fit); frozen scopes that do not fit stay in the files and are
            read into a staging ring (page-locked on CUDA) ahead of their use in the learned
            order, compressed ones from a cache file written at load. Reads through such a
            parameter (`p.data`, `state_dict()`) read the file; writes raise. The staging ring
            (`2 + prefetch` of the largest such scope) comes on top. Not combinable with
            `cast="host"`. `None`: every master in RAM.
            Model-wide: taken from the policy given to `load`.
        experts: which parameters are routed experts, stacked along their first dimension: a
            load in forward leaves them out and an op copies in only the experts it reads
            (`w[idx]`; for whole-tensor ops such as grouped_mm, the experts the router chose),
            so a decode token moves the experts it uses, not the layer's all (Note [routed
            experts] in scopes/experts.py). `"auto"` (default): the parameters of a module named
            `experts` that are stacked per expert (transformers' MoE models: `gate_up_proj`,
            `down_proj`, their biases). A callable `experts(qualified_name, param) -> bool`
            marks them (a module of your own indexing a stacked weight). `None`: none, every
            scope loads whole.
        expert_cache: device bytes that keep routed experts' rows across tokens for the scopes
            that stream (kept scopes keep their own): a row an op needs is copied from there,
            device to device, instead of from the host; rows are kept by how often and how
            recently they were used, and dropped when their master is written (Note [expert
            cache] in scopes/expert_cache.py; `summary()` shows the hit rate and the bytes held).
            Under a `vram_budget` in bytes the cache is carved from the budget: kept scopes are
            chosen within `vram_budget - expert_cache`, which must still hold the streaming
            room; not with `vram_budget="auto"`. `None` (default): no cache. Model-wide.
    """

    prefetch: int = 1
    max_scope_bytes: int | float | str | None = None  # an int once made (byte_size)
    keep_for_backward: bool = False
    pin_memory: bool | Literal["ring"] | None = None
    param_filter: Callable[[str, nn.Parameter], bool] | None = None
    compute_dtype: torch.dtype | None = None
    cast: Literal["device", "host"] = "device"
    vram_budget: int | float | str | None = None  # an int or "auto" once made
    layout: Literal["auto", "timed", "spread"] = "auto"
    frozen_format: str | None = None  # a registered name (formats.py)
    host_budget: int | float | str | None = None  # an int once made
    experts: Literal["auto"] | Callable[[str, nn.Parameter], bool] | None = "auto"
    expert_cache: int | float | str | None = None  # an int once made

    def __post_init__(self) -> None:
        _check_count(self.prefetch, "prefetch")
        for name in ("max_scope_bytes", "vram_budget", "host_budget", "expert_cache"):
            value = getattr(self, name)
            if value is not None and not (name == "vram_budget" and value == "auto"):
                # Frozen: the parsed size replaces what was given, so the policy holds bytes.
                object.__setattr__(self, name, byte_size(value, f"offtensor.Policy: {name}",
                                                         also=_ALSO_ACCEPTED[name]))
        if not isinstance(self.keep_for_backward, bool):
            raise TypeError(f"offtensor.Policy: keep_for_backward must be True or False, got "
                            f"{self.keep_for_backward!r}")
        if self.compute_dtype is not None and not (
            isinstance(self.compute_dtype, torch.dtype) and self.compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"offtensor.Policy: compute_dtype must be a floating-point torch.dtype such as "
                f"torch.bfloat16, got {self.compute_dtype!r}"
            )
        if self.param_filter is not None and not callable(self.param_filter):
            raise TypeError(
                "offtensor.Policy: param_filter must be callable as param_filter(qualified_name, "
                f"param) -> bool (e.g. offtensor.frozen_only), or None; got {type(self.param_filter).__name__}"
            )
        self._check_choices()

    def _check_choices(self) -> None:
        """The options chosen from a few values, and the combinations refused."""
        if not (self.experts is None or self.experts == "auto" or callable(self.experts)):
            raise ValueError("offtensor.Policy: experts must be 'auto', None or callable as "
                             f"experts(qualified_name, param) -> bool, got {self.experts!r}")
        if self.expert_cache is not None and self.vram_budget == "auto":
            raise ValueError(
                "offtensor.Policy: expert_cache does not combine with vram_budget='auto', which sizes the budget "
                "from a measured step's free memory; give vram_budget in bytes (the cache is carved from it)")
        if self.layout not in ("auto", "timed", "spread"):
            raise ValueError(f"offtensor.Policy: layout must be 'auto', 'timed' or 'spread', got {self.layout!r}")
        if self.cast not in ("device", "host"):
            raise ValueError(f"offtensor.Policy: cast must be 'device' or 'host', got {self.cast!r}")
        if self.frozen_format is not None and self.frozen_format not in frozen_format_names():
            raise ValueError(f"offtensor.Policy: frozen_format must be {describe_frozen_formats()} or None, got "
                             f"{self.frozen_format!r} (the formats registered in offtensor.formats)")
        if not any(self.pin_memory is v for v in (None, True, False)) and self.pin_memory != "ring":
            raise ValueError(
                f"offtensor.Policy: pin_memory must be None, True, False or 'ring', got {self.pin_memory!r}")
        if self.cast == "host" and (self.host_budget is not None or self.pin_memory == "ring"):
            raise ValueError(
                "offtensor.Policy: cast='host' does not combine with host_budget or pin_memory='ring': "
                "it keeps a host copy in compute_dtype beside the masters, which those bound. Use "
                "cast='device' (the default)")
        if self.frozen_format is not None and self.cast == "host":
            raise ValueError(
                "offtensor.Policy: frozen_format and cast='host' do not combine: cast='host' keeps "
                "a host copy in compute_dtype, which would undo the compression of frozen "
                "masters. Use cast='device' (the default) with frozen_format")


# What a size field of Policy takes besides a byte size, for its error messages.
_ALSO_ACCEPTED = {"max_scope_bytes": " or None", "vram_budget": ", 'auto' or None", "host_budget": " or None",
                  "expert_cache": " or None"}

# Byte units, case-insensitive: decimal (powers of 1000) and binary (powers of 1024), as
# accelerate's max_memory and most tools write them.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def byte_size(value: object, what: str, *, also: str = "") -> int:
    """A positive number of bytes from an int, a float (`1.5e9`) or a string with a unit
    (`"16GiB"`, `"16GB"`, `"512 MiB"`, `"1.5GiB"`); fractions of a byte are dropped. Raises
    TypeError or ValueError naming `what` ("offtensor.Policy: host_budget"), with an example;
    `also`: what else the field takes, for the message."""
    expected = (f"{what} must be a positive number of bytes (an int, a float such as 1.5e9, or a "
                f"string such as '16GiB', '16GB' or '512MiB'){also}")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{expected}; got {value!r} ({type(value).__name__})")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(f"{expected} (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB); got {value!r}")
        nbytes = int(decimal.Decimal(match.group(1)) * unit)  # exact: "1.1GB" is 1100000000
    elif isinstance(value, numbers.Integral):
        nbytes = operator.index(value)  # numpy integers too
    else:
        if not math.isfinite(float(value)):
            raise ValueError(f"{expected}; got {value!r}")
        nbytes = math.floor(float(value))
    if nbytes <= 0:
        raise ValueError(f"{expected}; got {value!r}")
    return nbytes


def _check_count(value: object, what: str) -> None:
    """An int >= 0 option (not a bool, a subclass of int that is never meant as a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"offtensor.Policy: {what} must be an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"offtensor.Policy: {what} must be an int >= 0, got {value!r}")


def frozen_only(name: str, param: nn.Parameter) -> bool:
    """`Policy.param_filter` for LoRA/PEFT: offload the parameters that do not require grad."""
    return not param.requires_grad


def format_bytes(nbytes: int) -> str:
    """`nbytes` in the largest binary unit it reaches, as `summary()` prints sizes: "512 B",
    "16.2 KiB", "2.8 MiB", "1.5 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class ScopeSummary:
    """One scope of `summary()`: what it offloads and where its bytes are now."""

    name: str
    state: ScopeState
    num_params: int  # number of elements
    host_bytes: int  # bytes of the host masters
    device_bytes: int  # bytes the scope holds on the compute device right now
    loads: int = 0  # host-to-device loads since wrap
    loads_on_demand: int = 0  # of which not prefetched in time: the compute waited for the copy
    kept: bool = False  # resident by Policy.vram_budget
    carried: bool = False  # left resident by a backward or inference pass for the next forward (Policy.vram_budget)
    masters: MasterHome = MasterHome.PINNED  # where the masters live
    file_bytes: int = 0  # bytes of the masters read from files at each load (MasterHome.FILE)
    # The parameters' bytes as the model sees them (numel x element size; a quantized weight's
    # packed tensors), whatever the host layout (padding, compression) takes.
    param_bytes: int = 0
    # Device bytes of the scope's weights while loaded: what a kept scope takes of the budget,
    # also when an optimizer step has freed its stale copy until the next forward loads it.
    loaded_bytes: int = 0
    residency: Residency = Residency.STREAMED

    # Host-to-device bytes since wrap: loads, routed expert rows, temporary copies, old gradients
    bytes_to_device: int = 0
    expert_hits: int = 0  # routed expert rows an op needed that were on the device already
    expert_misses: int = 0  # routed expert rows copied for an op (Note [routed experts])

    @property
    def expert_hit_rate(self) -> float | None:
        """Of the routed expert rows ops needed, the share already on the device; None: none."""
        n = self.expert_hits + self.expert_misses
        return self.expert_hits / n if n else None


@dataclass(frozen=True)
class TensorsSummary:
    """Parameters or buffers of the model that offtensor does not offload, and where they are."""

    count: int = 0  # tensors
    numel: int = 0
    nbytes: int = 0  # numel x element size, wherever they are
    device_bytes: int = 0  # of nbytes, on the compute device
    host_bytes: int = 0  # of nbytes, on the CPU when the compute device is another

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], device: torch.device) -> TensorsSummary:
        nbytes = [t.numel() * t.element_size() for t in tensors]
        on_device = [t.device.type == device.type and (device.index is None or t.device.index == device.index)
                     for t in tensors]
        on_host = [not d and t.device.type == "cpu" for t, d in zip(tensors, on_device, strict=True)]
        return cls(len(tensors), sum(t.numel() for t in tensors), sum(nbytes),
                   sum(n for n, d in zip(nbytes, on_device, strict=True) if d),
                   sum(n for n, h in zip(nbytes, on_host, strict=True) if h))


@dataclass(frozen=True)
class Layout:
    """What the VRAM budget keeps, and, for a timed layout, the step it predicts (ms)."""

    budget: int  # bytes (for vram_budget="auto": as sized from the measured step)
    kept_bytes: int
    streamed_bytes: int
    timed: bool  # chosen from measured times (layout="timed"); False: by bytes
    predicted_forward_ms: float | None = None
    predicted_backward_ms: float | None = None  # 0.0 when the measured pass had no backward
    expert_cache: int = 0  # bytes of the budget left to Policy.expert_cache (kept scopes fit in the rest)


@dataclass(frozen=True)
class Summary:
    """What is offloaded, what is resident, and how much memory each part of the model takes:
    the scopes, the parameters left out of them (`not_offloaded`) and the buffers. Printed, it
    is a table whose total row adds up to the model's bytes (`model_bytes`)."""

    device: str
    scopes: list[ScopeSummary] = field(default_factory=list)
    device_allocated: int | None = None  # torch.cuda.memory_allocated on CUDA, else None
    layout: Layout | None = None  # under Policy(vram_budget=...)
    expert_cache_bytes: int | None = None  # routed expert rows held now under Policy(expert_cache); None: no cache
    staging_bytes: int = 0  # the staging ring's host memory (Policy.host_budget, pin_memory="ring")
    file_bytes_read: int = 0  # bytes read from files into the staging ring since wrap
    not_offloaded: TensorsSummary = field(default_factory=TensorsSummary)  # parameters outside the scopes
    buffers: TensorsSummary = field(default_factory=TensorsSummary)  # never offloaded

    @property
    def host_bytes(self) -> int:
        """The scopes' host masters."""
        return sum(s.host_bytes for s in self.scopes)

    @property
    def device_bytes(self) -> int:
        """What the scopes hold on the compute device now."""
        return sum(s.device_bytes for s in self.scopes)

    @property
    def model_bytes(self) -> int:
        """The parameters' and buffers' bytes (numel x element size), offloaded or not."""
        return sum(s.param_bytes for s in self.scopes) + self.not_offloaded.nbytes + self.buffers.nbytes

    @property
    def bytes_to_device(self) -> int:
        """Host-to-device bytes of every scope since wrap."""
        return sum(s.bytes_to_device for s in self.scopes)

    def __str__(self) -> str:
        rows: list[tuple[str, ...]] = [
            ("scope", "state", "masters", "params", "size", "host", "device", "loaded", "loads", "on demand",
             "to device")]
        for s in self.scopes:
            note = " (kept)" if s.kept else " (carried)" if s.carried else ""
            rows.append((s.name, s.state.value + note, s.masters.value, f"{s.num_params:,}",
                         *map(format_bytes, (s.param_bytes, s.host_bytes, s.device_bytes, s.loaded_bytes)),
                         str(s.loads), str(s.loads_on_demand), format_bytes(s.bytes_to_device)))
        rest, buffers = self.not_offloaded, self.buffers
        if rest.count:
            rows.append(("not offloaded", "", "", f"{rest.numel:,}", *map(format_bytes, (
                rest.nbytes, rest.host_bytes, rest.device_bytes)), "", "", "", ""))
        if buffers.count:
            rows.append(("buffers", "", "", "", *map(format_bytes, (
                buffers.nbytes, buffers.host_bytes, buffers.device_bytes)), "", "", "", ""))
        rows.append(("total", "", "", f"{sum(s.num_params for s in self.scopes) + rest.numel:,}", *map(format_bytes, (
            self.model_bytes, self.host_bytes + rest.host_bytes + buffers.host_bytes,
            self.device_bytes + rest.device_bytes + buffers.device_bytes)), "",
            str(sum(s.loads for s in self.scopes)), str(sum(s.loads_on_demand for s in self.scopes)),
            format_bytes(self.bytes_to_device)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        return "\n".join([self._head(), *lines, *self._tail()])

    def _head(self) -> str:
        head = f"offtensor: {len(self.scopes)} scopes computing on {self.device}"
        if self.device_allocated is not None:
            head += f", device memory allocated {format_bytes(self.device_allocated)}"
        if self.expert_cache_bytes is not None:
            hits = sum(s.expert_hits for s in self.scopes)
            needed = hits + sum(s.expert_misses for s in self.scopes)
            head += (f"; expert cache holds {format_bytes(self.expert_cache_bytes)}"
                     + (f", expert hit rate {hits / needed:.0%}" if needed else ""))
        if self.staging_bytes:
            in_files = sum(s.file_bytes for s in self.scopes)
            head += (f"; {format_bytes(in_files)} in files, staging ring {format_bytes(self.staging_bytes)}, "
                     f"{format_bytes(self.file_bytes_read)} read")
        return head

    def _tail(self) -> list[str]:
        if self.layout is None:
            return []
        lay = self.layout
        carried = sum(s.device_bytes for s in self.scopes if s.carried)
        line = (f"layout ({'timed' if lay.timed else 'by bytes'}): budget {format_bytes(lay.budget)}, kept "
                f"{format_bytes(lay.kept_bytes)}, streamed {format_bytes(lay.streamed_bytes)}, carried "
                f"{format_bytes(carried)}")
        if lay.expert_cache:
            line += f", expert cache {format_bytes(lay.expert_cache)}"
        if lay.predicted_forward_ms is not None:
            line += (f"; predicted forward {lay.predicted_forward_ms:.1f} ms, "
                     f"backward {lay.predicted_backward_ms:.1f} ms")
        return [line]
