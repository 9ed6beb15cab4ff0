"""--shape 8b|34b|70b: the real models' sizes. Their random weights are generated where they are
used, never as a whole model on the host: a peer's model is built on the meta device and
filled scope by scope by `offtensor.load` (or, resident, allocated on the device and filled
there) with `RandomFill`. What does not fit is skipped with the reason (`fit_problem`), and
offtensor-capped's full fine-tune runs under a VRAM cap (`vram_cap`).

# Note [random weights at real shapes]
A 70B model in bf16 is 140 GB: more than the benchmark host's RAM, and generating its values on
the CPU takes minutes (normal_ runs at about 0.15 G values/s per core). So `RandomFill` makes
each module's values on the compute device (a CUDA generator: well under a second for all 70B),
in the parameters `offtensor.load(init_device=device)` allocated there for one scope at a time;
offtensor.load then copies them into the scope's pinned buffer (or, fp8, quantizes them on the
device and copies the 1-byte values and scales) and frees them. The generator is seeded from
the seed and the module's name, so every peer, and the resident model filled on the device, gets
the same weights. What is left of a load's time is
the device-to-host copies and page-locking the host buffers: RandomFill prints the expected
total after the first layers.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from .measure import GiB, available_host_bytes
from .model import BuiltModel
from .scenarios import ModelShape, Scenario

STD = 0.02  # the Llama config's initializer_range
HOST_HEADROOM = 0.9  # of MemAvailable: what a peer may plan to use
DEVICE_HEADROOM = 0.95  # of the GPU's memory


class RandomFill:
    """offtensor.load's `init` (and `materialize`'s): normal(0, 0.02) matrices, ones for 1-D
    parameters (norm weights), zeros for LoRA's B; generated on `device` (Note [random weights
    at real shapes]). `scaled`: normal matrices of std 1/sqrt(fan_in) and zero biases instead (the DiT,
    whose modulations and biases would otherwise grow its activations block after block). With
    `layer_bytes`, prints the expected time of the whole load after the first two layers' worth
    of parameters."""

    def __init__(self, device: torch.device, seed: int, total_bytes: int = 0, layer_bytes: int = 0,
                 scaled: bool = False) -> None:
        self.device = device
        self.seed = seed
        self.scaled = scaled
        self.total_bytes, self.layer_bytes = total_bytes, layer_bytes
        self.done_bytes = 0
        self.t0: float | None = None
        self.estimate_s: float | None = None

    def start(self, total_bytes: int, layer_bytes: int) -> None:
        """A new load of `total_bytes` begins (the same fill serves each peer's load)."""
        self.total_bytes, self.layer_bytes = total_bytes, layer_bytes
        self.done_bytes, self.t0, self.estimate_s = 0, time.perf_counter(), None

    def __call__(self, name: str, module: nn.Module) -> None:
        self._progress()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        with torch.no_grad():
            for pname, p in module.named_parameters(recurse=False):
                std = p[0].numel() ** -0.5 if self.scaled and p.dim() >= 2 else STD
                if p.dim() < 2:
                    p.fill_(0.0 if self.scaled and pname == "bias" else 1.0)
                elif "lora_B" in name:
                    p.zero_()
                elif p.device == self.device:
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.copy_(torch.empty(p.shape, dtype=p.dtype, device=self.device).normal_(0.0, std, generator=gen))
                self.done_bytes += p.numel() * p.element_size()

    def _progress(self) -> None:
        """After two layers' parameters were generated and stored (a scope's are generated at
        its start, then stored), the expected time of the whole load."""
        if self.estimate_s is not None or self.t0 is None or not self.layer_bytes:
            return
        if self.done_bytes < 2 * self.layer_bytes or self.done_bytes >= self.total_bytes:
            return
        elapsed = time.perf_counter() - self.t0
        self.estimate_s = elapsed * self.total_bytes / self.done_bytes
        print(f"    loading: {self.done_bytes / 1e9:.1f} of {self.total_bytes / 1e9:.1f} GB in {elapsed:.1f} s; "
              f"expected load time {self.estimate_s:.0f} s", flush=True)


def expected_load_s(nbytes: int, compressed: bool) -> float:
    """A first guess of a load's time, before it starts (RandomFill measures the real rate):
    device-to-host copies and page-locking at about 4 GB/s of the bytes kept on the host (half
    of them compressed: the quantization runs on the device)."""
    return nbytes / (8e9 if compressed else 4e9)


def activation_bytes(shape: ModelShape, s: Scenario) -> int:
    """A rough upper bound on a scenario's activations (bf16) on the device: the logits (and
    their fp32 loss copies), one layer's intermediates, and in training each layer's saved
    input (activation checkpointing)."""
    tokens = s.batch * s.seq
    logits = tokens * shape.vocab * (2 if s.kind == "infer" else 10)
    layer = tokens * (6 * shape.hidden + 3 * shape.intermediate) * 2
    saved = 0 if s.kind == "infer" else tokens * shape.hidden * 2 * shape.layers
    return logits + layer + saved


def resident_bytes(built: BuiltModel, shape: ModelShape, s: Scenario) -> int:
    """Device bytes of the resident model in scenario `s`: weights, and for training the
    gradients (and for a full step AdamW's two states) of what is trainable, plus activations."""
    trainable = sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad)
    per_trainable = {"infer": 0, "train": 1, "frozen": 1, "frozen-step": 3, "full": 3, "step": 3}.get(s.kind, 3)
    return built.total_bytes + per_trainable * trainable + activation_bytes(shape, s)


def offloaded_host_bytes(built: BuiltModel, peer: str, s: Scenario) -> int:
    """Host bytes an offtensor peer holds for `s`: the masters (frozen matrices in about half
    with fp8/int8), and in training the trainable masters' gradients (and AdamW's states),
    plus one layer in full precision while it loads."""
    layers = built.wrapped_bytes
    frozen = built.wrapped_bytes - built.wrapped_trainable_bytes
    trainable = 0 if s.kind in ("infer", "frozen", "frozen-step") else built.wrapped_trainable_bytes
    if peer == "offtensor-capped":  # embeddings and head offloaded too
        trainable = built.total_bytes
        layers = built.total_bytes
    masters = layers - frozen // 2 if peer.endswith(("-fp8", "-int8")) else layers
    per_trainable = {"train": 1, "full": 3}.get(s.kind, 0)
    return masters + per_trainable * trainable + layers // max(len(built.layers), 1)


def fit_problem(peer: str, built: BuiltModel, shape: ModelShape, s: Scenario, device: torch.device,
                held: int = 0) -> str | None:
    """Why `peer` cannot run `s` with this model on this machine (it would not fit in host or
    device memory), or None. Checked before the model is placed, from its meta parameters, or,
    for a model already placed, with `held`: the host bytes it already holds (they are no longer
    available, and count once)."""
    if peer == "resident":
        need = resident_bytes(built, shape, s)
        if device.type == "cuda":
            have = int(torch.cuda.get_device_properties(device).total_memory * DEVICE_HEADROOM)
            where = f"the GPU has {have / GiB:.0f} GiB usable"
        else:
            have = int((available_host_bytes() or need) * HOST_HEADROOM)
            where = f"{have / GiB:.0f} GiB of host memory available"
        if need > have:
            return f"does not fit: needs about {need / GiB:.0f} GiB on the device, {where}"
        return None
    if not peer.startswith("offtensor"):
        return None
    need = offloaded_host_bytes(built, peer, s) - held
    available = available_host_bytes()
    if available is not None and need > available * HOST_HEADROOM:
        return (f"does not fit: needs about {need / GiB:.0f} GiB of host memory, "
                f"{available * HOST_HEADROOM / GiB:.0f} GiB available")
    return None


@contextlib.contextmanager
def vram_cap(device: torch.device, cap_bytes: int) -> Iterator[None]:
    """`torch.cuda.set_per_process_memory_fraction(cap / total)` for the block (the caching
    allocator raises an out-of-memory error beyond it), then back to the whole device. On the
    CPU there is no device memory to cap: says so and runs the block uncapped."""
    if device.type != "cuda":
        print(f"    VRAM cap of {cap_bytes / GiB:.1f} GiB: not applied (no CUDA device)", flush=True)
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    print(f"    VRAM capped at {cap_bytes / GiB:.1f} GiB of {total / GiB:.0f} GiB", flush=True)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
