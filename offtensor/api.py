"""User-facing option and report types."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn


class ScopeState(enum.Enum):
    """Where a scope's parameters live. See Note [scope states] in core/scope.py."""

    OFFLOADED = "offloaded"  # host master only; the device storage has size 0
    LOADING = "loading"  # host-to-device copy enqueued; compute has not waited for it yet
    RESIDENT = "resident"  # compute stream waited on weights_ready; device copy usable


class Residency(enum.Enum):
    """How long a scope's device copy outlives its calls, beside its ScopeState (Note [VRAM
    budget] and Note [carried into the next forward] in budget/vram.py). Fixed by the budget's
    layout for KEPT; STREAMED and CARRIED alternate for the others."""

    STREAMED = "streamed"  # loaded for its calls, released when they end
    KEPT = "kept"  # resident by Policy.vram_budget: only a forced release offloads it
    CARRIED = "carried"  # streamed, left resident by a backward for the next forward; any release ends it


class MasterHome(enum.Enum):
    """Where a scope's masters live on the host and how a load reads them (Note [staged loads]
    in weights/staging.py), beside its ScopeState."""

    PINNED = "pinned"  # page-locked RAM, copied to the device directly
    PAGEABLE = "pageable"  # pageable RAM, copied directly (Policy(pin_memory=False))
    RING = "ring"  # pageable RAM, staged through the page-locked staging ring
    FILE = "file"  # in a checkpoint or cache file, read into the staging ring (Policy.host_budget)


@dataclass(frozen=True)
class Policy:
    """Options for `offtensor.wrap`, passed through whole.

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
            slower. `"ring"`: masters and grads stay pageable, and each load stages through a
            small page-locked ring (Note [staged loads] in weights/staging.py), so page-locked
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
        vram_budget: device bytes the scopes' weights may take together (Note [VRAM budget] in
            budget/vram.py). Scopes whose weights fit next to what streaming the others needs
            (the largest block computing, the one before it, `prefetch` blocks in flight) stay
            resident, the first in the order `wrap` found them and the others spread evenly
            over that order: in inference they load once; in training, once per step (an
            optimizer step changes their masters) instead of in forward and again in backward.
            A backward leaves the streamed scopes the next forward starts with resident, within
            the streaming room (Note [carried into the next forward]). `summary()` shows which
            (kept, carried). `"auto"`: the budget is what the device had free at the peak of
            the second step (activations included), less a margin: every scope streams until
            then. `None`: every scope streams. Model-wide: taken from the policy given to `wrap`.
        layout: how the VRAM budget chooses what to keep. `"timed"`: from the second pass's
            measured compute per scope and the link's bandwidth, the set whose simulated step
            is shortest (Note [a timed layout] in budget/layout.py), chosen when the third pass starts;
            `summary()` shows its predicted step. `"spread"`: by bytes, spread evenly over the
            order, from the first pass. `"auto"` (default): `"timed"` on CUDA, `"spread"` on a
            CPU compute device (nothing overlaps there, so timing has nothing to win).
        frozen_format: `"fp8"` (float8 e4m3) or `"int8"`: keep frozen offloaded parameters
            (requires_grad False at wrap: a LoRA base, every weight of a model for inference)
            compressed on the host, one byte per element plus one scale per output row, and
            dequantize them on the device into the compute dtype as they load: host RAM and
            PCIe bytes about halve (from bf16). Matrices only; 1-D parameters (norms, biases)
            and small tensors stay as they are. Lossy: the compressed values become the
            parameter's values (`p`, `state_dict()` report them); writes through the parameter
            requantize, and unfreezing it raises (Note [compressed masters] in weights/compress.py).
            Not combinable with `cast="host"`. `None`: masters keep their dtype.
        host_budget: bytes of host RAM the offloaded masters may take, for `offtensor.load`
            from safetensors files (Note [masters in files] in weights/file_masters.py). Scopes with a
            trainable parameter stay in RAM (an error says so when they do not fit); frozen
            scopes that do not fit stay in the files and are read into the staging ring on
            demand, ahead of their use in the learned order, compressed ones from a cache file
            written at load. Reads through such a parameter (`p.data`, `state_dict()`) read the
            file; writes raise. The staging ring (`2 + prefetch` of the largest such scope)
            comes on top. Not combinable with `cast="host"`. `None`: every master in RAM.
            Model-wide: taken from the policy given to `load`.
    """

    prefetch: int = 1
    max_scope_bytes: int | None = None
    keep_for_backward: bool = False
    pin_memory: bool | Literal["ring"] | None = None
    param_filter: Callable[[str, nn.Parameter], bool] | None = None
    compute_dtype: torch.dtype | None = None
    cast: Literal["device", "host"] = "device"
    vram_budget: int | Literal["auto"] | None = None
    layout: Literal["auto", "timed", "spread"] = "auto"
    frozen_format: Literal["fp8", "int8"] | None = None
    host_budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"offtensor.Policy: prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.max_scope_bytes is not None and (
            not isinstance(self.max_scope_bytes, int) or self.max_scope_bytes <= 0
        ):
            raise ValueError(
                f"offtensor.Policy: max_scope_bytes must be a positive int or None, got {self.max_scope_bytes!r}"
            )
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
        if self.vram_budget is not None and self.vram_budget != "auto" and (
                not isinstance(self.vram_budget, int) or self.vram_budget <= 0):
            raise ValueError(
                f"offtensor.Policy: vram_budget must be a positive int (bytes), 'auto' or None, "
                f"got {self.vram_budget!r}"
            )
        if self.layout not in ("auto", "timed", "spread"):
            raise ValueError(f"offtensor.Policy: layout must be 'auto', 'timed' or 'spread', got {self.layout!r}")
        if self.cast not in ("device", "host"):
            raise ValueError(f"offtensor.Policy: cast must be 'device' or 'host', got {self.cast!r}")
        if self.frozen_format not in (None, "fp8", "int8"):
            raise ValueError(
                f"offtensor.Policy: frozen_format must be 'fp8', 'int8' or None, got {self.frozen_format!r}")
        if self.pin_memory not in (None, True, False, "ring"):
            raise ValueError(
                f"offtensor.Policy: pin_memory must be None, True, False or 'ring', got {self.pin_memory!r}")
        if self.host_budget is not None and (
                isinstance(self.host_budget, bool) or not isinstance(self.host_budget, int) or self.host_budget <= 0):
            raise ValueError(
                f"offtensor.Policy: host_budget must be a positive int (bytes) or None, got {self.host_budget!r}")
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


def frozen_only(name: str, param: nn.Parameter) -> bool:
    """`Policy.param_filter` for LoRA/PEFT: offload the parameters that do not require grad."""
    return not param.requires_grad


@dataclass(frozen=True)
class ScopeSummary:
    name: str
    state: ScopeState
    num_params: int  # number of elements
    host_bytes: int  # bytes of the host masters
    device_bytes: int  # bytes the scope holds on the compute device right now
    loads: int = 0  # host-to-device loads since wrap
    loads_on_demand: int = 0  # of which not prefetched in time: the compute waited for the copy
    kept: bool = False  # resident by Policy.vram_budget
    carried: bool = False  # left resident by a backward for the next forward (Policy.vram_budget)
    masters: MasterHome = MasterHome.PINNED  # where the masters live (Note [staged loads])
    file_bytes: int = 0  # bytes of the masters read from files at each load (MasterHome.FILE)


@dataclass(frozen=True)
class Layout:
    """What the VRAM budget keeps, and, for a timed layout, the step it predicts (ms)."""

    budget: int  # bytes (for vram_budget="auto": as sized from the measured step)
    kept_bytes: int
    streamed_bytes: int
    timed: bool  # chosen from measured times (Note [a timed layout]); False: by bytes
    predicted_forward_ms: float | None = None
    predicted_backward_ms: float | None = None  # 0.0 when the measured pass had no backward


@dataclass(frozen=True)
class Summary:
    """What is offloaded, what is resident, and how much device memory each scope takes."""

    device: str
    scopes: list[ScopeSummary] = field(default_factory=list)
    device_allocated: int | None = None  # torch.cuda.memory_allocated on CUDA, else None
    layout: Layout | None = None  # under Policy(vram_budget=...)
    staging_bytes: int = 0  # the staging ring's host memory (Note [staged loads])
    file_bytes_read: int = 0  # bytes read from files into the staging ring since wrap

    @property
    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.scopes)

    @property
    def device_bytes(self) -> int:
        return sum(s.device_bytes for s in self.scopes)

    def __str__(self) -> str:
        rows = [("scope", "state", "masters", "params", "host MiB", "device MiB", "loads", "on demand")]
        for s in self.scopes:
            note = " (kept)" if s.kept else " (carried)" if s.carried else ""
            rows.append(
                (s.name, s.state.value + note, s.masters.value, f"{s.num_params:,}",
                 f"{s.host_bytes / 2**20:.1f}", f"{s.device_bytes / 2**20:.1f}", str(s.loads),
                 str(s.loads_on_demand))
            )
        rows.append(("total", "", "", f"{sum(s.num_params for s in self.scopes):,}",
                     f"{self.host_bytes / 2**20:.1f}", f"{self.device_bytes / 2**20:.1f}",
                     str(sum(s.loads for s in self.scopes)),
                     str(sum(s.loads_on_demand for s in self.scopes))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        head = f"offtensor: {len(self.scopes)} scopes computing on {self.device}"
        if self.device_allocated is not None:
            head += f", device memory allocated {self.device_allocated / 2**20:.1f} MiB"
        if self.staging_bytes:
            in_files = sum(s.file_bytes for s in self.scopes)
            head += (f"; {in_files / 2**20:.1f} MiB in files, staging ring {self.staging_bytes / 2**20:.1f} MiB, "
                     f"{self.file_bytes_read / 2**20:.1f} MiB read")
        tail = []
        if self.layout is not None:
            lay = self.layout
            tail.append(f"layout ({'timed' if lay.timed else 'by bytes'}): budget {lay.budget / 2**20:.0f} MiB, kept "
                        f"{lay.kept_bytes / 2**20:.0f} MiB, streamed {lay.streamed_bytes / 2**20:.0f} MiB, carried "
                        f"{sum(s.device_bytes for s in self.scopes if s.carried) / 2**20:.0f} MiB")
            if lay.predicted_forward_ms is not None:
                tail[-1] += (f"; predicted forward {lay.predicted_forward_ms:.1f} ms, "
                             f"backward {lay.predicted_backward_ms:.1f} ms")
        return "\n".join([head, *lines, *tail])
