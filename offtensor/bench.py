"""Benchmark offtensor against the whole model on the GPU and against other offloading libraries.

Runs a randomly initialised Hugging Face Llama (no download) through six scenarios and, for each
*peer* (a way of placing the model), reports the median wall time, the roofline, peak device
memory and host memory growth. docs/benchmarks.md defines every column; in short:

    roofline = max(time of the same scenario with the whole model resident on the device,
                   bytes that must cross PCIe / measured pinned bandwidth)

plus, for the full training steps (step-4x2048, step32-4x2048), the CPU optimizer step: added
for `loss.backward(); optimizer.step()`, overlapped (max) for `offtensor.backward_and_step`.

Usage:

    python -m offtensor.bench                          # 8 layers, every scenario and peer
    python -m offtensor.bench --layers 16 --peers resident offtensor --json out.json
    python -m offtensor.bench --scenarios step-4x2048 --peers resident offtensor offtensor-overlap
    python -m offtensor.bench --quick --device cpu     # smoke test: tiny model, no GPU needed

Peers other than offtensor are optional: one that is not installed, or that fails, is reported
with a note and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import nn

from offtensor import _overlap as offtensor_overlap

GiB = 2**30

# --------------------------------------------------------------------------------------------
# What is run
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the Llama that is built (random weights, bf16)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int


FULL_SHAPE = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=8)
QUICK_SHAPE = ModelShape(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1024, layers=2)


@dataclass(frozen=True)
class Scenario:
    """One workload. kind: 'infer' (no_grad forward), 'train' (all params trainable),
    'frozen' (decoder layers frozen, a small trainable part), 'step' (a full training step:
    forward, backward, fused AdamW step, zero_grad) or 'step32' (the same with fp32 masters and
    bf16 compute)."""

    name: str
    kind: str
    batch: int
    seq: int
    micro_batches: int = 1  # forward+backward passes per timed iteration (grad accumulation)

    @property
    def variant(self) -> str:
        # Scenarios of the same variant share one freshly built model per peer.
        return {"frozen": "lora", "step32": "fp32"}.get(self.kind, "base")

    @property
    def has_optimizer(self) -> bool:
        return self.kind in ("step", "step32")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("infer-1x512", "infer", 1, 512),  # transfer-bound
        Scenario("infer-8x2048", "infer", 8, 2048),  # compute-bound
        Scenario("train-4x2048", "train", 4, 2048, micro_batches=2),
        # Right after train-4x2048: same variant, so each peer reuses the model it built.
        Scenario("step-4x2048", "step", 4, 2048),
        Scenario("lora-4x2048", "frozen", 4, 2048, micro_batches=2),
        Scenario("step32-4x2048", "step32", 4, 2048),
    )
}


def _quick(s: Scenario) -> Scenario:
    return Scenario(s.name, s.kind, min(s.batch, 2), max(16, s.seq // 32), s.micro_batches)


PEER_NAMES = ("resident", "offtensor", "offtensor-overlap", "offtensor-castdev", "offtensor-casthost",
              "accelerate", "diffusers")

ADAMW_LR = 1e-5
FP32_BUILD_LIMIT_S = 60.0  # step32-4x2048 is skipped when building the fp32 model takes longer


def peer_plan(peer: str, scenario: Scenario) -> str | None:
    """'run'; or the note of a 'skipped' row; or None: the peer has no row for this scenario
    (the offtensor variants are only different from `offtensor` where they have a row)."""
    if peer == "offtensor-overlap":
        return "run" if scenario.kind == "step" else None
    if peer in ("offtensor-castdev", "offtensor-casthost"):
        return "run" if scenario.kind == "step32" else None
    if peer == "offtensor":
        return None if scenario.kind == "step32" else "run"  # fp32 masters: the -cast* peers
    if peer in ("accelerate", "diffusers") and scenario.has_optimizer:
        return "no optimizer integration"
    return "run"


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds `fn` takes, its device work included."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _host_rss() -> int | None:
    """Resident set size of this process in bytes (psutil, else /proc/self/status)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # cuBLAS keeps a workspace per handle and stream in allocated memory; it outlives the
        # peer that made it and would count in the next peer's peak memory.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        # Pinned blocks freed by tensors stay cached by PyTorch's host allocator; give them back
        # so the next peer's host-memory baseline is clean. The name moved between releases.
        for fn in (getattr(torch.accelerator, "empty_host_cache", None),
                   getattr(torch._C, "_host_emptyCache", None)):
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()
                break


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - a broken install is reported as missing
        return None
    return str(getattr(module, "__version__", "unknown"))


# --------------------------------------------------------------------------------------------
# Bandwidth
# --------------------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> dict[str, Any]:
    """Pinned host<->device copy bandwidth in bytes/s, median of `reps` timed copies.

    On CUDA: one large pinned buffer, CUDA events around each copy, plus both directions at
    once on two streams (for reference; the roofline uses the one-way numbers). On the CPU, the
    "transfer" offtensor does is a memcpy between two host buffers, timed with perf_counter.
    """
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "method": None}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
            samples = []
            for i in range(reps + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                if i >= 2:  # first two are warm-up
                    samples.append(start.elapsed_time(end) / 1e3)
            return nbytes / statistics.median(samples)

        out["method"] = "pinned, CUDA events"
        out["h2d"] = timed(dev, host)
        out["d2h"] = timed(host, dev)

        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        samples = []
        for i in range(reps + 2):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.cuda.stream(s1):
                dev.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(dev2, non_blocking=True)
            torch.cuda.synchronize(device)
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        out["bidirectional_total"] = 2 * nbytes / statistics.median(samples)
        del host, host2, dev, dev2
        _free_memory(device)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        samples = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            if i >= 1:
                samples.append(time.perf_counter() - t0)
        out["method"] = "host memcpy, perf_counter"
        out["h2d"] = out["d2h"] = nbytes / statistics.median(samples)
        out["bidirectional_total"] = None
    return out


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    # transformers' own random init of billions of bf16 values takes tens of seconds on the CPU;
    # we skip it and fill the weights from the device's generator instead (_fill_random).
    for path in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(path, fromlist=["no_init_weights"])
            return module.no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _fill_random(model: nn.Module, device: torch.device, seed: int) -> None:
    """Normal(0, 0.02) matrices, ones for norm weights; generated on `device`, stored in place."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                p.fill_(1.0)
                continue
            src = torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            p.copy_(src)
            del src


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (also found inside a peft-injected model)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    for m in lists:
        if type(m[0]).__name__.endswith("DecoderLayer"):
            return m
    if not lists:
        raise RuntimeError("bench: the model has no nn.ModuleList of layers")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


@dataclass
class BuiltModel:
    variant: str  # 'base' or 'lora'
    vocab: int
    model: nn.Module
    layers: nn.ModuleList
    trainable: str  # what requires grad, in words
    total_bytes: int  # all parameters
    wrapped_bytes: int  # decoder-layer parameters: what an offloader moves
    wrapped_trainable_bytes: int  # decoder-layer parameters that get a grad
    dtype: torch.dtype = torch.bfloat16  # of the parameters


def build_model(shape: ModelShape, variant: str, device: torch.device, seed: int) -> BuiltModel:
    """A random-weight bf16 LlamaForCausalLM with SDPA attention, parameters on the CPU.

    variant 'fp32': the same in fp32 (masters for step32-4x2048, which computes in bf16).

    variant 'lora': every base parameter frozen; LoRA adapters (r=16 on q/k/v/o) trainable when
    peft is installed, otherwise the input embeddings (so that backward still runs through every
    decoder layer).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    # attn_implementation is stored by the base config from **kwargs; typed stubs do not know it.
    config = cast(Any, LlamaConfig)(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    with _no_init_weights(), _default_dtype(dtype), torch.device("cpu"):
        model = LlamaForCausalLM(config)
    _fill_random(model, device, seed)

    trainable = "all parameters"
    if variant == "lora":
        model.requires_grad_(False)
        peft: Any
        try:
            import peft
        except ImportError:
            peft = None
        if peft is not None:
            lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            peft.inject_adapter_in_model(lora, model)
            for name, p in model.named_parameters():
                is_lora = "lora_" in name
                p.requires_grad_(is_lora)
                if is_lora and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
            trainable = "peft LoRA r=16 on q/k/v/o_proj; base frozen"
        else:
            model.get_input_embeddings().weight.requires_grad_(True)
            trainable = "input embeddings only (peft not installed); decoder layers frozen"

    layers = decoder_layers(model)
    def nbytes(ps: Iterable[torch.Tensor]) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    return BuiltModel(
        variant=variant,
        vocab=shape.vocab,
        model=model,
        layers=layers,
        trainable=trainable,
        total_bytes=nbytes(model.parameters()),
        wrapped_bytes=nbytes(layers.parameters()),
        wrapped_trainable_bytes=nbytes(p for p in layers.parameters() if p.requires_grad),
        dtype=dtype,
    )


def _place_outside(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer that is not in `layers` to `device`, in place.

    For peers whose hooks own the layers' placement, where a plain `model.to(device)` would
    pull the offloaded weights onto the device too.
    """
    inside = {id(m) for m in layers.modules()}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in inside:
                continue
            for _name, p in module._parameters.items():
                if p is not None:
                    p.data = p.data.to(device)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)


def _checkpointing_on(model: nn.Module) -> bool:
    # transformers 5.x renamed the property (the old name warns); older ones only have the old.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: nn.Module) -> None:
    # transformers 5.2x renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    hf_model: Any = model
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# --------------------------------------------------------------------------------------------
# Peers: each places a freshly built CPU model for computing on `device`, in place
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerOptions:
    offtensor_prefetch: int | None = None
    offtensor_max_scope_mib: float | None = None


def _setup_resident(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    built.model.to(device)
    return "whole model on the device"


def _setup_offtensor(built: BuiltModel, device: torch.device, opts: PeerOptions,
                     cast: str | None = None) -> str:
    import offtensor

    options: dict[str, Any] = {}
    if opts.offtensor_prefetch is not None:
        options["prefetch"] = opts.offtensor_prefetch
    if opts.offtensor_max_scope_mib is not None:
        options["max_scope_bytes"] = int(opts.offtensor_max_scope_mib * 2**20)
    if cast is not None:
        # fp32 masters (and their grads and AdamW state) on the host, bf16 copies on the device.
        options["compute_dtype"] = torch.bfloat16
        options["cast"] = cast
    frozen_only = getattr(offtensor, "frozen_only", None)
    if built.variant == "lora" and frozen_only is not None:
        # Offload the frozen base; the small trainable adapters stay on the device, so nothing
        # but the base weights crosses PCIe (host-to-device only).
        options["param_filter"] = frozen_only
    policy = offtensor.Policy(**options) if options else None
    # Default predicate (every element of every nn.ModuleList): the decoder layers.
    offtensor.wrap(built.model, device=device, policy=policy)
    built.model.to(device)  # embeddings, final norm, head, rotary buffers; masters stay on the host
    shown = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={getattr(v, '__name__', v)}"
                      for k, v in options.items())
    return f"offtensor.wrap(model, device={str(device)!r}, policy=Policy({shown}))"


def _setup_accelerate(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    from accelerate import cpu_offload

    _place_outside(built.model, built.layers, device)
    for layer in built.layers:
        cpu_offload(layer, execution_device=device)
    return "accelerate.cpu_offload on each decoder layer"


def _setup_diffusers(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    from diffusers.hooks import apply_group_offloading

    use_stream = device.type == "cuda"  # diffusers refuses streams on the CPU
    _place_outside(built.model, built.layers, device)
    # Applied per decoder layer: diffusers traces the execution order from the forward of the
    # module it is given, and an nn.ModuleList has no forward, so giving it `layers` would
    # disable prefetching; per layer, each leaf prefetches the next one within the layer.
    for layer in built.layers:
        apply_group_offloading(layer, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=use_stream)
    return f"diffusers apply_group_offloading(leaf_level, use_stream={use_stream}) on each decoder layer"


PEER_SETUP: dict[str, Callable[[BuiltModel, torch.device, PeerOptions], str]] = {
    "resident": _setup_resident,
    "offtensor": _setup_offtensor,
    "offtensor-overlap": _setup_offtensor,  # same placement; the step uses backward_and_step
    "offtensor-castdev": lambda b, d, o: _setup_offtensor(b, d, o, cast="device"),
    "offtensor-casthost": lambda b, d, o: _setup_offtensor(b, d, o, cast="host"),
    "accelerate": _setup_accelerate,
    "diffusers": _setup_diffusers,
}
PEER_MODULE = {"resident": None, "offtensor": "offtensor", "offtensor-overlap": "offtensor",
               "offtensor-castdev": "offtensor", "offtensor-casthost": "offtensor",
               "accelerate": "accelerate", "diffusers": "diffusers"}


def peer_unavailable(peer: str) -> str | None:
    """Why `peer` cannot run here, or None."""
    module = PEER_MODULE[peer]
    if module is None:
        return None
    try:
        __import__(module if peer != "diffusers" else "diffusers.hooks")
    except Exception as exc:  # noqa: BLE001 - not installed, or broken on import
        return f"not available: {_short_error(exc)}"
    return None


# --------------------------------------------------------------------------------------------
# Measuring one scenario
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    peer: str
    status: str  # ok | error | skipped
    note: str = ""
    batch: int = 0
    seq: int = 0
    times_ms: list[float] = field(default_factory=list)  # per iteration (per micro-batch in training)
    median_ms: float | None = None
    peak_vram_bytes: int | None = None
    vram_before_bytes: int | None = None  # allocated when the scenario starts (weights at rest)
    host_growth_bytes: int | None = None  # RSS now minus RSS before this peer's model was built
    grads_kept: float | None = None  # fraction of trainable layer params with a .grad after backward
    grad_devices: list[str] | None = None
    optimizer: str | None = None  # step scenarios: the optimizer(s) and how they were stepped
    fwd_bwd_ms: float | None = None  # resident, step scenarios: forward+backward alone, no step
    fwd_ms: float | None = None  # resident, step scenarios: the forward (and loss) alone
    overlap: dict | None = None  # offtensor-overlap: the last step's OverlapReport, in ms
    same_time: dict | None = None  # offtensor-overlap: measure_same_time
    roofline_ms: float | None = None
    ratio: float | None = None


def _grad_state(layers: nn.ModuleList) -> tuple[float | None, list[str]]:
    trainable = [p for p in layers.parameters() if p.requires_grad]
    if not trainable:
        return None, []
    grads = [p.grad for p in trainable if p.grad is not None]
    devices = sorted({str(g.device) + (" pinned" if g.is_pinned() else "") for g in grads})
    return len(grads) / len(trainable), devices


def make_adamw(params: list[torch.Tensor]) -> tuple[list[torch.optim.Optimizer], str]:
    """`torch.optim.AdamW(params, lr=1e-5, fused=True)`: one optimizer when torch accepts
    parameters on several devices in it (its fused step groups tensors by device and dtype),
    else one per device type, the CPU one first."""
    devices = sorted({p.device.type for p in params}, key=lambda d: d != "cpu")
    try:
        return [torch.optim.AdamW(params, lr=ADAMW_LR, fused=True)], \
            f"one fused AdamW over {'+'.join(devices)} parameters"
    except (RuntimeError, ValueError) as exc:
        if len(devices) < 2:
            raise
        why = _short_error(exc)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW([p for p in params if p.device.type == d], lr=ADAMW_LR, fused=True)
        for d in devices]
    return opts, f"one fused AdamW per device ({', '.join(devices)}); one over all refused: {why}"


# --------------------------------------------------------------------------------------------
# The CPU optimizer step on its own
# --------------------------------------------------------------------------------------------


def _fill_from_pool(t: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """Fill `t` with values from `pool` (random normals), cyclically: random data at memcpy
    speed. The AdamW kernel's speed does not depend on the values (none are denormal)."""
    flat, n, k = t.view(-1), t.numel(), pool.numel()
    pos = 0
    while pos < n:
        start = (offset + pos) % k
        m = min(n - pos, k - start)
        flat[pos:pos + m].copy_(pool[start:start + m])
        pos += m


def _random_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(1 << 22, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)


def _timed_steps(optimizers: list[torch.optim.Optimizer], reps: int) -> list[list[float]]:
    """One warm-up step of each optimizer (allocates its state), then `reps` rounds stepping
    each in turn (interleaved, so that both see the same machine). Seconds per step."""
    for opt in optimizers:
        opt.step()
    out: list[list[float]] = [[] for _ in optimizers]
    for _ in range(reps):
        for i, opt in enumerate(optimizers):
            t0 = time.perf_counter()
            opt.step()
            out[i].append(time.perf_counter() - t0)
    return out


def _plain_like(params: Sequence[torch.Tensor], pool: torch.Tensor) -> list[torch.Tensor]:
    """Plain CPU tensors of the same shapes and dtype as `params`, random values and grads."""
    plain, offset = [], 0
    for p in params:
        t = torch.empty(p.shape, dtype=p.dtype)
        _fill_from_pool(t, pool, offset)
        t.grad = torch.empty_like(t)
        _fill_from_pool(t.grad, pool, offset + 7919)
        offset += p.numel()
        plain.append(t)
    return plain


def _gparams(numel: int, seconds: float) -> float:
    return numel / seconds / 1e9


def measure_plain_adamw(params: Sequence[torch.Tensor], seed: int, reps: int = 5, *,
                        device: torch.device | None = None,
                        pcie_bytes: tuple[int, int] | None = None) -> dict[str, Any]:
    """The optimizer term of the step rooflines: fused `torch.optim.AdamW` on plain CPU tensors
    of the shapes and dtype of `params` (the wrapped parameters), with random grads; one
    warm-up step, median of `reps`. On CUDA with `pcie_bytes` (a step's host-to-device and
    device-to-host bytes), also the same step beside those copies: see `_adamw_beside_copies`."""
    dtype = params[0].dtype
    plain = _plain_like(params, _random_pool(dtype, seed))
    numel = sum(p.numel() for p in plain)
    opt = torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)
    (times,) = _timed_steps([opt], reps)
    median = statistics.median(times)
    out = {"dtype": str(dtype).removeprefix("torch."), "params": numel, "tensors": len(plain),
           "warmup": 1, "reps": reps, "times_ms": [t * 1e3 for t in times],
           "median_ms": median * 1e3, "gparams_per_s": _gparams(numel, median),
           "threads": torch.get_num_threads()}
    if device is not None and device.type == "cuda" and pcie_bytes is not None:
        try:
            out["beside_copies"] = _adamw_beside_copies(opt, device, *pcie_bytes, reps=reps)
        except Exception as exc:  # noqa: BLE001 - reported; the time alone stands
            out["beside_copies"] = {"error": _short_error(exc)}
    return out


def _adamw_beside_copies(opt: torch.optim.Optimizer, device: torch.device, h2d_bytes: int,
                         d2h_bytes: int, reps: int, piece: int = 256 * 2**20, free: bool = True) -> dict[str, Any]:
    """The optimizer step while pinned copies of one training step's PCIe traffic run, both
    directions on their own streams, enqueued just before the step, with the thread count of
    `backward_and_step`'s worker. The copy engines read and write host memory, and a CPU
    AdamW is bound by host memory bandwidth: this is the optimizer term of an overlapped step
    on this host, which no scheduling can beat (scripts/host_contention.py measures more)."""
    host_in = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(piece, dtype=torch.uint8, device=device)
    dev_out = torch.empty(piece, dtype=torch.uint8, device=device)
    s_in, s_out = torch.cuda.Stream(device), torch.cuda.Stream(device)
    threads = max(1, torch.get_num_threads() - offtensor_overlap.SPARE_THREADS)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize(device)
            with torch.cuda.stream(s_in):
                for _ in range(-(-h2d_bytes // piece)):
                    dev_in.copy_(host_in, non_blocking=True)
            with torch.cuda.stream(s_out):
                for _ in range(-(-d2h_bytes // piece)):
                    host_out.copy_(dev_out, non_blocking=True)
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize(device)
    finally:
        torch.set_num_threads(old_threads)
        try:
            torch.cuda.synchronize(device)  # no copy may still use the buffers freed below
        finally:
            del host_in, host_out, dev_in, dev_out
    if free:
        _free_memory(device)  # pinned blocks back to the OS: not counted in this peer's host memory
    return {"threads": threads, "h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes,
            "times_ms": [t * 1e3 for t in times], "median_ms": statistics.median(times) * 1e3}


def measure_same_time(step: Callable[[], None], drain: Callable[[], None], params: Sequence[torch.Tensor],
                      seed: int, device: torch.device, pcie_bytes: tuple[int, int],
                      variants: Sequence[tuple[int, int]], rounds: int = 3, steps: int = 3) -> dict[str, Any]:
    """The overlapped step and the plain optimizer step measured in turn, minutes not apart.

    The CPU AdamW step on the benchmark's host drifts by 20-30 % between minutes (other
    tenants' memory traffic), so a ratio of two measurements taken in different peers swings
    with it. Each of `rounds` rounds runs, for each worker setting in `variants` ((spare
    threads, piece bytes)), `steps` overlapped training steps (the last one's deferred steps
    drained and counted, as in the main timing), then the plain fused AdamW on plain CPU
    tensors shaped as `params`, alone (every thread) and, on CUDA, beside one step's PCIe copies
    (the default setting's worker threads). Medians over the rounds."""
    plain = _plain_like(params, _random_pool(params[0].dtype, seed))
    opt = torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)
    opt.step()  # allocates the state
    default = (offtensor_overlap.SPARE_THREADS, offtensor_overlap.STEP_PIECE_BYTES)
    per_variant: list[list[float]] = [[] for _ in variants]
    alone: list[float] = []
    beside: list[float] = []
    beside_threads = None
    try:
        for _ in range(rounds):
            for i, (spare, piece) in enumerate(variants):
                offtensor_overlap.SPARE_THREADS, offtensor_overlap.STEP_PIECE_BYTES = spare, piece
                total = sum(_timed(device, step) for _ in range(steps)) + _timed(device, drain)
                per_variant[i].append(total / steps * 1e3)
            offtensor_overlap.SPARE_THREADS, offtensor_overlap.STEP_PIECE_BYTES = default
            alone.append(_timed(device, opt.step) * 1e3)
            if device.type == "cuda":
                m = _adamw_beside_copies(opt, device, *pcie_bytes, reps=1, free=False)
                beside += m["times_ms"]
                beside_threads = m["threads"]
    finally:
        offtensor_overlap.SPARE_THREADS, offtensor_overlap.STEP_PIECE_BYTES = default
    return {"rounds": rounds, "steps": steps,
            "variants": [{"spare_threads": spare, "piece_mib": piece / 2**20, "times_ms": times,
                          "median_ms": statistics.median(times)}
                         for (spare, piece), times in zip(variants, per_variant)],
            "alone_ms": alone, "alone_median_ms": statistics.median(alone),
            "beside_ms": beside, "beside_median_ms": statistics.median(beside) if beside else None,
            "beside_threads": beside_threads}


def measure_optimizer_speed(layers: nn.ModuleList, seed: int, reps: int = 5) -> dict[str, Any]:
    """Fused AdamW on the wrapped model's offloaded parameters (random host .grad set on each)
    against the same step on plain CPU tensors of identical shapes and dtypes: what the
    parameter subclass costs the optimizer. One warm-up step each, then `reps` interleaved
    steps of each, median. The wrapped weights change by a few lr-sized steps; the grads are
    set back to None afterwards."""
    params = [p for p in layers.parameters() if p.requires_grad and p.device.type == "cpu"]
    if not params:
        raise RuntimeError("no trainable CPU parameters in the decoder layers")
    dtype = params[0].dtype
    pool = _random_pool(dtype, seed)
    offset = 0
    for p in params:
        g = torch.empty(p.shape, dtype=p.dtype)
        _fill_from_pool(g, pool, offset + 7919)
        offset += p.numel()
        p.grad = g
    plain = _plain_like(params, pool)
    numel = sum(p.numel() for p in params)
    try:
        wrapped_t, plain_t = _timed_steps([torch.optim.AdamW(params, lr=ADAMW_LR, fused=True),
                                           torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)], reps)
    finally:
        for p in params:
            p.grad = None
    wrapped_s, plain_s = statistics.median(wrapped_t), statistics.median(plain_t)
    ratio = plain_s / wrapped_s  # = wrapped G params/s over plain G params/s
    return {"dtype": str(dtype).removeprefix("torch."), "params": numel, "tensors": len(params),
            "warmup": 1, "reps": reps, "threads": torch.get_num_threads(),
            "wrapped_times_ms": [t * 1e3 for t in wrapped_t], "plain_times_ms": [t * 1e3 for t in plain_t],
            "wrapped_ms": wrapped_s * 1e3, "plain_ms": plain_s * 1e3,
            "wrapped_gparams_per_s": _gparams(numel, wrapped_s),
            "plain_gparams_per_s": _gparams(numel, plain_s),
            "ratio": ratio, "target": 0.95, "meets_target": ratio >= 0.95}


def run_scenario(built: BuiltModel, scenario: Scenario, device: torch.device, *, warmup: int,
                 iters: int, max_seconds: float, seed: int, row: Row, peer: str = "",
                 overlap_variants: Sequence[tuple[int, int]] = (), overlap_rounds: int = 3) -> None:
    """Fill `row` with the timings and memory of `scenario` on the placed model `built`; for
    offtensor-overlap on CUDA also `row.same_time` (measure_same_time, each worker setting of
    `overlap_variants`, default: the current one)."""
    model, layers = built.model, built.layers
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    ids = torch.randint(0, built.vocab, (scenario.batch, scenario.seq), device=device,
                        generator=gen)
    optimizers: list[torch.optim.Optimizer] = []
    overlap_reports: list[Any] = []  # offtensor-overlap: each step's OverlapReport

    def drain() -> None:
        """Wait for the deferred optimizer steps (offtensor-overlap) still running."""
        if overlap_reports:
            overlap_reports[-1].wait()

    if scenario.has_optimizer:
        model.train()
        if not _checkpointing_on(model):
            enable_checkpointing(model)
        optimizers, row.optimizer = make_adamw([p for p in model.parameters() if p.requires_grad])
        overlap = peer == "offtensor-overlap"
        if overlap:
            import offtensor

            row.optimizer += "; offtensor.backward_and_step(loss, " + (
                "optimizer)" if len(optimizers) == 1 else "CPU optimizer), then the other stepped")
        else:
            row.optimizer += "; loss.backward(), then optimizer.step()"
        # fp32 weights, bf16 compute: autocast on the forward (the recompute in backward
        # restores it). Wrapped layers already hold bf16 device copies; resident casts per op.
        autocast = scenario.kind == "step32"
        if autocast:
            row.optimizer += "; forward under torch.autocast(bfloat16)"

        def forward_loss() -> torch.Tensor:
            with (torch.autocast(device.type, dtype=torch.bfloat16) if autocast
                  else contextlib.nullcontext()):
                return model(input_ids=ids, labels=ids, use_cache=False).loss

        def train_step(check: bool = False) -> None:
            loss = forward_loss()
            if overlap:
                # The offloaded scopes' steps finish in the background during the next forward
                # (zero_grad=True zeroes each grad after its step: no wait); the timing loop
                # waits for the last one (`drain`), so a step's time is the steady-state period.
                overlap_reports.append(offtensor.backward_and_step(loss, optimizers[0], zero_grad=not check))
                for opt in optimizers[1:]:
                    opt.step()
            else:
                loss.backward()
                for opt in optimizers:
                    opt.step()
            del loss
            if check:  # the first warm-up step also tells whether the grads landed in p.grad
                row.grads_kept, row.grad_devices = _grad_state(layers)
                if row.grads_kept is not None and row.grads_kept < 1.0:
                    row.note = (f"only {row.grads_kept:.0%} of the trainable layer parameters had "
                                "a .grad at the optimizer step: not a valid training step")
            for opt in optimizers[1:] if overlap and not check else optimizers:
                opt.zero_grad(set_to_none=True)

        step: Callable[[], None] = train_step
        per_step = 1
    elif scenario.kind == "infer":
        model.eval()

        def step() -> None:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

        per_step = 1
    else:
        model.train()
        if not _checkpointing_on(model):
            enable_checkpointing(model)

        def step() -> None:
            for _ in range(scenario.micro_batches):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
            model.zero_grad(set_to_none=True)

        per_step = scenario.micro_batches

    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        row.vram_before_bytes = torch.cuda.memory_allocated(device)

    def timed(fn: Callable[[], None]) -> float:
        return _timed(device, fn)

    def first_step() -> None:
        # The first warm-up iteration also tells whether the grads landed in p.grad.
        if scenario.has_optimizer:
            train_step(check=True)
            return
        if scenario.kind == "infer":
            step()
            return
        for _ in range(scenario.micro_batches):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            del loss
        row.grads_kept, row.grad_devices = _grad_state(layers)
        if row.grads_kept is not None and row.grads_kept < 1.0:
            row.note = (f"only {row.grads_kept:.0%} of the trainable layer parameters had a .grad "
                        "after backward: not a valid training step")
        model.zero_grad(set_to_none=True)

    last = timed(first_step)
    for _ in range(warmup - 1):
        last = timed(step)
    drain()
    # A peer much slower than expected gets fewer iterations rather than stalling the run.
    if last * iters > max_seconds:
        iters = max(1, min(iters, int(max_seconds // max(last, 1e-9))))
        row.note = (row.note + f" iterations cut to {iters} (warm-up took {last:.1f} s)").strip()

    times = [timed(step) / per_step for _ in range(iters)]
    # Steps that finish in the background belong to the loop: the last one's rest is added to
    # the last iteration (the earlier ones ran inside the next iteration's time).
    times[-1] += timed(drain) / per_step
    if overlap_reports:
        report = overlap_reports[-1]
        row.overlap = {
            "backward_ms": report.backward_s * 1e3, "total_ms": report.total_s * 1e3,
            "rest_params": report.rest_params, "pieces": report.pieces, "early_pieces": report.early_pieces,
            "worker_busy_ms": report.worker_busy_s * 1e3,
            "spare_threads": offtensor_overlap.SPARE_THREADS,
            "piece_bytes": offtensor_overlap.STEP_PIECE_BYTES,
            "scopes": [{"scope": n, "queued_ms": q * 1e3, "started_ms": g * 1e3,
                        "stepped_ms": d * 1e3} for n, q, g, d in report.scopes],
        }

    row.times_ms = [t * 1e3 for t in times]
    row.median_ms = statistics.median(row.times_ms)
    if device.type == "cuda":
        row.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
    if overlap_reports:
        params = [p for p in layers.parameters() if p.requires_grad and p.device.type == "cpu"]
        variants = overlap_variants or [(offtensor_overlap.SPARE_THREADS, offtensor_overlap.STEP_PIECE_BYTES)]
        try:
            row.same_time = measure_same_time(step, drain, params, seed, device,
                                              step_pcie_bytes(built, scenario), variants, rounds=overlap_rounds)
        except Exception as exc:  # noqa: BLE001 - reported; the main timing stands
            row.same_time = {"error": _short_error(exc)}
        _free_memory(device)
    if scenario.has_optimizer and peer == "resident":
        # The compute term of the step rooflines when train-4x2048 has no resident time (and of
        # step32-4x2048, whose forward runs under autocast): forward+backward, no optimizer.
        def fwd_bwd() -> None:
            forward_loss().backward()
            model.zero_grad(set_to_none=True)

        def fwd() -> None:
            forward_loss()

        row.fwd_bwd_ms = statistics.median(timed(fwd_bwd) * 1e3 for _ in range(max(iters, 1)))
        row.fwd_ms = statistics.median(timed(fwd) * 1e3 for _ in range(max(iters, 1)))
    optimizers.clear()  # frees the optimizer state
    if scenario.kind != "infer":
        model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@dataclass
class VariantBytes:
    total_bytes: int
    wrapped_bytes: int
    wrapped_trainable_bytes: int
    trainable: str
    dtype: str = "bfloat16"


def _iterations(args: argparse.Namespace, scenario: Scenario) -> tuple[int, int]:
    """(warm-up, timed) iterations: a few per scenario keeps the full 8-layer run to minutes."""
    if scenario.has_optimizer:  # a full step takes about a second; the CPU optimizer is noisy
        return args.warmup or 2, args.iters or (2 if args.quick else 5)
    warmup = args.warmup or (1 if args.quick else 2)
    iters = args.iters or (2 if args.quick else 5 if scenario.kind == "infer" else 3)
    return warmup, iters


@dataclass
class Extras:
    """Measurements beside the rows, shared by the peers of one run."""

    plain_adamw: dict[str, dict[str, Any]] = field(default_factory=dict)  # dtype -> measure_plain_adamw
    optimizer_speed: dict[str, Any] | None = None  # bf16, measured in the offtensor peer
    optimizer_speed_fp32: dict[str, Any] | None = None  # fp32 masters, in offtensor-castdev
    skipped_variants: dict[str, str] = field(default_factory=dict)  # variant -> why (too slow to build)


class _SkipVariant(Exception):
    pass


def step_pcie_bytes(built: BuiltModel, scenario: Scenario) -> tuple[int, int]:
    """(host-to-device, device-to-host) bytes of one training step of the standard peer
    (step_roofline): weights in twice (forward, recompute), gradients out once."""
    h2d_per_byte = next(iter(STEP_PEERS[scenario.kind].values()))[0]
    return int(2 * built.wrapped_bytes * h2d_per_byte), built.wrapped_trainable_bytes


def _measure_extras(peer: str, scenario: Scenario, built: BuiltModel, device: torch.device, seed: int,
                    extras: Extras) -> None:
    """Before a step scenario: the plain-CPU AdamW time for its roofline (once per dtype), and
    in the offtensor peers the wrapped-vs-plain optimizer microbenchmark."""
    dtype = str(built.dtype).removeprefix("torch.")
    if dtype not in extras.plain_adamw:
        params = [p for p in built.layers.parameters() if p.requires_grad]
        try:
            extras.plain_adamw[dtype] = measure_plain_adamw(params, seed, device=device,
                                                            pcie_bytes=step_pcie_bytes(built, scenario))
            m = extras.plain_adamw[dtype]
            beside = m.get("beside_copies") or {}
            print(f"  plain CPU fused AdamW ({dtype}, {m['params'] / 1e6:,.1f} M params): "
                  f"{m['median_ms']:.1f} ms, {m['gparams_per_s']:.3g} G params/s"
                  + (f"; {beside['median_ms']:.1f} ms with {beside['threads']} threads beside a step's "
                     f"PCIe copies" if "median_ms" in beside else
                     f"; beside a step's PCIe copies: {beside['error']}" if "error" in beside else ""),
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the rooflines go without it
            extras.plain_adamw[dtype] = {"dtype": dtype, "error": _short_error(exc)}
            print(f"  plain CPU fused AdamW ({dtype}): {_short_error(exc)}", flush=True)
    attr = {("offtensor", "step"): "optimizer_speed",
            ("offtensor-castdev", "step32"): "optimizer_speed_fp32"}.get((peer, scenario.kind))
    if attr is None or getattr(extras, attr) is not None:
        return
    try:
        result = measure_optimizer_speed(built.layers, seed)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and the log
        result = {"dtype": dtype, "error": _short_error(exc)}
        print(f"  {attr}: {result['error']}", flush=True)
    else:
        print(f"  {attr} (fused AdamW, {dtype}, {result['params'] / 1e6:,.1f} M params): offloaded "
              f"{result['wrapped_gparams_per_s']:.3g} G params/s, plain CPU "
              f"{result['plain_gparams_per_s']:.3g} G params/s, ratio {result['ratio']:.3f} "
              f"(target >= {result['target']})", flush=True)
    setattr(extras, attr, result)


def run_peer(peer: str, scenarios: list[Scenario], shape: ModelShape, device: torch.device,
             args: argparse.Namespace, rows: list[Row], variant_bytes: dict[str, VariantBytes],
             setups: dict[str, Any], extras: Extras | None = None) -> None:
    """Every scenario for one peer, appended to `rows`: one fresh model per variant, and a
    fresh one again after a failed scenario (the peer's state may be half-updated)."""
    opts = PeerOptions(offtensor_prefetch=args.offtensor_prefetch,
                       offtensor_max_scope_mib=args.offtensor_max_scope_mib)
    extras = extras if extras is not None else Extras()
    built: BuiltModel | None = None
    rss0: int | None = None
    setup_failed: dict[str, str] = {}  # variant -> note

    for scenario in scenarios:
        row = Row(scenario.name, peer, "ok", batch=scenario.batch, seq=scenario.seq)
        rows.append(row)
        if built is not None and built.variant != scenario.variant:
            built = None
            _free_memory(device)
        if scenario.variant in extras.skipped_variants:
            row.status, row.note = "skipped", extras.skipped_variants[scenario.variant]
            print(f"  {peer}/{scenario.name}: skipped, {row.note}", flush=True)
            continue
        if scenario.variant in setup_failed:
            row.status, row.note = "error", setup_failed[scenario.variant]
            continue

        error: str | None = None
        if built is None:
            _free_memory(device)
            rss0 = _host_rss()
            try:
                built = _build_and_place(peer, scenario.variant, shape, device, args.seed, opts,
                                         variant_bytes, setups)
            except _SkipVariant as exc:
                extras.skipped_variants[scenario.variant] = str(exc)
                row.status, row.note = "skipped", str(exc)
                print(f"  {peer}/{scenario.name}: skipped, {exc}", flush=True)
                _free_memory(device)
                continue
            except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
                error = f"setup failed: {_short_error(exc)}"
            if error is not None:  # outside the except block, so the traceback no longer holds the model
                row.status, row.note = "error", error
                setup_failed[scenario.variant] = error
                print(f"  {peer}/{scenario.name}: {error}", flush=True)
                built = None
                _free_memory(device)
                continue
        assert built is not None

        if scenario.has_optimizer:
            _measure_extras(peer, scenario, built, device, args.seed, extras)
        try:
            warmup, iters = _iterations(args, scenario)
            run_scenario(built, scenario, device, warmup=warmup, iters=iters,
                         max_seconds=args.max_scenario_s, seed=args.seed, row=row, peer=peer,
                         overlap_variants=args.overlap_variants, overlap_rounds=args.overlap_rounds)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
            error = _short_error(exc)
        if error is not None:
            row.status, row.note = "error", f"{row.note} {error}".strip()
            row.times_ms, row.median_ms, row.peak_vram_bytes = [], None, None
            print(f"  {peer}/{scenario.name}: {row.note}", flush=True)
            built = None
            _free_memory(device)
            continue

        rss = _host_rss()
        if rss is not None and rss0 is not None:
            row.host_growth_bytes = rss - rss0
        print(f"  {peer}/{scenario.name}: median {row.median_ms:.2f} ms"
              + (f", peak VRAM {row.peak_vram_bytes / GiB:.2f} GiB" if row.peak_vram_bytes else "")
              + (f", host {row.host_growth_bytes / GiB:+.2f} GiB" if row.host_growth_bytes is not None else "")
              + (f", grads kept {row.grads_kept:.0%} {row.grad_devices}" if row.grads_kept is not None else "")
              + (f" ({row.note})" if row.note else ""),
              flush=True)
    built = None
    _free_memory(device)


def _build_and_place(peer: str, variant: str, shape: ModelShape, device: torch.device, seed: int,
                     opts: PeerOptions, variant_bytes: dict[str, VariantBytes],
                     setups: dict[str, Any]) -> BuiltModel:
    t0 = time.perf_counter()
    built = build_model(shape, variant, device, seed)
    t1 = time.perf_counter()
    if variant == "fp32" and t1 - t0 > FP32_BUILD_LIMIT_S:
        raise _SkipVariant(f"building the fp32 model took {t1 - t0:.0f} s (limit {FP32_BUILD_LIMIT_S:.0f} s)")
    variant_bytes.setdefault(variant, VariantBytes(
        built.total_bytes, built.wrapped_bytes, built.wrapped_trainable_bytes, built.trainable,
        str(built.dtype).removeprefix("torch.")))
    how = PEER_SETUP[peer](built, device, opts)
    _sync(device)
    info: dict[str, Any] = {"how": how, "build_s": t1 - t0, "setup_s": time.perf_counter() - t1,
                            "trainable": built.trainable}
    if peer.startswith("offtensor"):
        with contextlib.suppress(Exception):
            import offtensor

            info["summary"] = str(offtensor.summary(built.model))
    setups[f"{peer}/{variant}"] = info
    return built


STEP_PEERS = {  # step kind -> {peer: (H2D bytes per wrapped byte and pass, optimizer overlapped)}
    "step": {"offtensor": (1.0, False), "offtensor-overlap": (1.0, True)},
    # fp32 masters: cast="device" moves the fp32 bytes, cast="host" the bf16 copy (half).
    "step32": {"offtensor-castdev": (1.0, False), "offtensor-casthost": (0.5, False)},
}


def _ok_row(rows: list[Row], scenario: str, peer: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.peer == peer and r.status == "ok"), None)


def step_roofline(s: Scenario, rows: list[Row], bw: dict[str, Any], vb: VariantBytes | None,
                  extras: Extras) -> dict[str, Any]:
    """The roofline of a full training step, per offtensor peer (they move different bytes and
    overlap the optimizer or not):

        fwd+bwd  = max(compute, h2d_ms, d2h_ms)     as train-4x2048, 1 micro-batch
        standard = fwd+bwd + optimizer_ms           loss.backward(); optimizer.step()
        overlap  = max(fwd+bwd, optimizer_ms)       offtensor.backward_and_step

    Beside these (the issue's definitions), for reading the results: `phase_roofline_ms` of the
    standard peers bounds forward and backward each on its own, max(fwd, h2d/2) +
    max(bwd, h2d/2, d2h) + optimizer, since no copy can move from the forward into the
    backward (the weights must be loaded for the forward, which may be transfer-bound while
    the backward is compute-bound); `host_roofline_ms` of the overlapped peer takes the
    optimizer as fast as it runs beside the step's own copies (host memory bandwidth).
    """
    resident_train = _ok_row(rows, "train-4x2048", "resident")
    resident_own = _ok_row(rows, s.name, "resident")
    own = resident_own.fwd_bwd_ms if resident_own else None
    compute: float | None
    source: str | None
    # step32 runs its forward under autocast: its own resident fwd+bwd is the closer compute.
    if s.kind == "step32" and own is not None:
        compute, source = own, f"resident {s.name} forward+backward (autocast), measured alone"
    elif resident_train is not None:
        compute, source = resident_train.median_ms, "resident train-4x2048 (per micro-batch)"
    elif own is not None:
        compute, source = own, f"resident {s.name} forward+backward, measured alone"
    else:
        compute, source = None, None
    dtype = vb.dtype if vb else ("float32" if s.kind == "step32" else "bfloat16")
    opt = extras.plain_adamw.get(dtype, {})
    entry: dict[str, Any] = {"compute_ms": compute, "compute_source": source,
                             "optimizer_ms": opt.get("median_ms"),
                             "optimizer_source": f"fused torch.optim.AdamW on plain CPU {dtype} tensors "
                                                 "shaped as the wrapped parameters (median of 5)",
                             "optimizer_beside_copies_ms": opt.get("beside_copies", {}).get("median_ms"),
                             "peers": {}}
    notes = []
    if compute is None:
        notes.append("no resident time: the fwd+bwd term is the transfer term only")
    if entry["optimizer_ms"] is None:
        notes.append("no optimizer time: " + opt.get("error", "not measured"))
    for peer, (h2d_per_byte, overlapped) in STEP_PEERS[s.kind].items():
        p: dict[str, Any] = {}
        if vb is not None:
            h2d, d2h = int(2 * vb.wrapped_bytes * h2d_per_byte), vb.wrapped_trainable_bytes
            p.update(h2d_bytes=h2d, d2h_bytes=d2h, h2d_ms=h2d / bw["h2d"] * 1e3, d2h_ms=d2h / bw["d2h"] * 1e3)
        terms = [t for t in (compute, p.get("h2d_ms"), p.get("d2h_ms")) if t is not None]
        fb = max(terms) if terms else None
        p["fwd_bwd_roofline_ms"] = fb
        o = entry["optimizer_ms"]
        if fb is None:
            p["roofline_ms"] = None
        elif o is None:
            p["roofline_ms"] = fb
        else:
            p["roofline_ms"] = max(fb, o) if overlapped else fb + o
        beside = entry["optimizer_beside_copies_ms"]
        if overlapped and fb is not None and beside is not None:
            # The same with the optimizer as fast as it runs beside the step's own copies.
            p["host_roofline_ms"] = max(fb, beside)
        fwd = resident_own.fwd_ms if resident_own else None
        if not overlapped and o is not None and compute is not None and fwd is not None and "h2d_ms" in p:
            half = p["h2d_ms"] / 2  # each pass loads every weight once
            p["phase_roofline_ms"] = max(fwd, half) + max(compute - fwd, half, p["d2h_ms"]) + o
        p["formula"] = "max(fwd+bwd, optimizer)" if overlapped else "fwd+bwd + optimizer"
        entry["peers"][peer] = p
    first = next(iter(entry["peers"].values()))
    for k in ("h2d_bytes", "d2h_bytes", "h2d_ms", "d2h_ms", "roofline_ms"):
        entry[k] = first.get(k)  # the scenario's headline: the first (standard) peer's
    entry["roofline_peer"] = next(iter(entry["peers"]))
    if notes:
        entry["note"] = "; ".join(notes)
    return entry


def format_step_breakdown(name: str, e: dict[str, Any]) -> str:
    """One line: the terms of a step scenario's roofline and each peer's roofline."""
    peers = e["peers"]
    parts = [f"compute {_fmt(e['compute_ms'], '.1f')} ms"]
    h2ds = {p: v.get("h2d_ms") for p, v in peers.items()}
    if len(set(h2ds.values())) == 1:
        parts.append(f"h2d {_fmt(next(iter(h2ds.values())), '.1f')} ms")
    else:
        parts += [f"h2d {_fmt(v, '.1f')} ms ({p})" for p, v in h2ds.items()]
    parts.append(f"d2h {_fmt(e.get('d2h_ms'), '.1f')} ms")
    parts.append(f"optimizer {_fmt(e['optimizer_ms'], '.1f')} ms")
    if e.get("optimizer_beside_copies_ms") is not None:
        parts.append(f"optimizer beside the step's copies {e['optimizer_beside_copies_ms']:.1f} ms")
    rl = ", ".join(f"{p} {_fmt(v['roofline_ms'], '.1f')} ms ({v['formula']})" for p, v in peers.items())
    phases = ", ".join(f"{p} {v['phase_roofline_ms']:.1f} ms" for p, v in peers.items() if v.get("phase_roofline_ms"))
    return f"  {name}: {', '.join(parts)} -> roofline {rl}" + (
        f"; forward and backward bounded each on its own: {phases}" if phases else "")


def format_same_time(r: Row, fwd_bwd_ms: float | None) -> str:
    """The overlapped step against the plain optimizer step measured in turn with it."""
    st = r.same_time or {}
    if "error" in st:
        return f"  {r.peer}/{r.scenario} measured in turn with the plain step: {st['error']}"
    fb = fwd_bwd_ms or 0.0
    alone, beside = st["alone_median_ms"], st["beside_median_ms"]
    def listed(ts: list[float]) -> str:
        return ", ".join(f"{t:.0f}" for t in ts)

    lines = [f"  {r.peer}/{r.scenario} measured in turn with the plain step ({st['rounds']} rounds of "
             f"{st['steps']} steps; medians): AdamW alone {alone:.1f} ms ({listed(st['alone_ms'])})"
             + (f", beside the step's copies {beside:.1f} ms ({listed(st['beside_ms'])}; "
                f"{st['beside_threads']} threads)" if beside else "")]
    for v in st["variants"]:
        m = v["median_ms"]
        lines.append(f"    {v['spare_threads']} spare threads, {v['piece_mib']:.0f} MiB pieces: {m:.1f} ms "
                     f"({listed(v['times_ms'])}) = {m / max(fb, alone):.2f}x max(fwd+bwd, AdamW alone)"
                     + (f", {m / max(fb, beside):.2f}x max(fwd+bwd, AdamW beside copies)" if beside else ""))
    return "\n".join(lines)


def compute_rooflines(rows: list[Row], scenarios: list[Scenario], bw: dict[str, Any],
                      variant_bytes: dict[str, VariantBytes],
                      extras: Extras | None = None) -> dict[str, dict[str, Any]]:
    """Per scenario: the compute term (resident time), the transfer terms, and their max; for
    the step scenarios also the optimizer term, and a roofline per offtensor peer."""
    extras = extras if extras is not None else Extras()
    out: dict[str, dict[str, Any]] = {}
    for s in scenarios:
        vb = variant_bytes.get(s.variant)
        if s.has_optimizer:
            step_entry = out[s.name] = step_roofline(s, rows, bw, vb, extras)
            for r in rows:
                if r.scenario == s.name:
                    # resident steps on the device and moves nothing: no roofline of its own.
                    r.roofline_ms = step_entry["peers"].get(r.peer, {}).get("roofline_ms")
                    r.ratio = r.median_ms / r.roofline_ms if r.median_ms is not None and r.roofline_ms else None
            continue
        resident = next((r for r in rows if r.scenario == s.name and r.peer == "resident"
                         and r.status == "ok"), None)
        entry: dict[str, Any] = {"compute_ms": resident.median_ms if resident else None}
        if vb is not None:
            # Training re-loads every layer for the recompute in backward (checkpointing). A
            # frozen base needs only its frozen weights moved: the adapters can stay on the device.
            if s.kind == "infer":
                h2d, d2h = vb.wrapped_bytes, 0
            elif s.kind == "train":
                h2d, d2h = 2 * vb.wrapped_bytes, vb.wrapped_trainable_bytes
            else:
                h2d, d2h = 2 * (vb.wrapped_bytes - vb.wrapped_trainable_bytes), 0
            entry.update(h2d_bytes=h2d, d2h_bytes=d2h,
                         h2d_ms=h2d / bw["h2d"] * 1e3, d2h_ms=d2h / bw["d2h"] * 1e3)
            entry["transfer_ms"] = max(entry["h2d_ms"], entry["d2h_ms"])
        terms = [t for t in (entry["compute_ms"], entry.get("transfer_ms")) if t is not None]
        entry["roofline_ms"] = max(terms) if terms else None
        entry["bound"] = (None if not terms else "transfer" if entry["roofline_ms"] == entry.get("transfer_ms")
                          else "compute")
        if entry["compute_ms"] is None:
            entry["note"] = "no resident time: roofline is the transfer term only"
        out[s.name] = entry
        for r in rows:
            if r.scenario == s.name:
                r.roofline_ms = entry["roofline_ms"]
                if r.median_ms is not None and r.roofline_ms:
                    r.ratio = r.median_ms / r.roofline_ms
    return out


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    for name in ("offtensor", "transformers", "accelerate", "diffusers", "peft", "psutil"):
        env[name] = _version(name)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["driver"] = None
        with contextlib.suppress(Exception):
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False, capture_output=True, text=True, timeout=20).stdout.strip() or None
    return env


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[Row], bw: dict[str, Any], env: dict[str, Any], shape: ModelShape,
                 quick: bool) -> str:
    head = (f"{shape.layers} layers, hidden {shape.hidden}, bf16, on {env.get('gpu', env['device'])}, "
            f"torch {env['torch']} | H2D {bw['h2d'] / 1e9:.1f} GB/s, D2H {bw['d2h'] / 1e9:.1f} GB/s "
            f"({bw['method']})")
    table = [("scenario", "peer", "median ms", "roofline ms", "ratio", "peak VRAM GiB", "host GiB")]
    for r in rows:
        # --quick keeps the scenario names but shrinks the shapes: show the real one.
        name = f"{r.scenario} ({r.batch}x{r.seq})" if quick else r.scenario
        median = _fmt(r.median_ms, ".1f") if r.status == "ok" else r.status
        table.append((name, r.peer, median, _fmt(r.roofline_ms, ".1f"), _fmt(r.ratio, ".2f"),
                      _fmt(None if r.peak_vram_bytes is None else r.peak_vram_bytes / GiB, ".2f"),
                      _fmt(None if r.host_growth_bytes is None else r.host_growth_bytes / GiB, ".2f")))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = [" | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths)))
             for t in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join([head, *lines])


def _names(values: list[str], known: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = [n for v in values for n in v.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench: unknown {what} {unknown}; choose from {list(known)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m offtensor.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --quick)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS),
                   help=f"any of {list(SCENARIOS)} (space or comma separated; default all)")
    p.add_argument("--peers", nargs="+", default=list(PEER_NAMES),
                   help=f"any of {list(PEER_NAMES)} (default all; resident always runs first)")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="tiny model (hidden 256, 2 layers) and short sequences: a smoke test")
    p.add_argument("--device", default=None, help="compute device (default cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 2; 1 with --quick)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default 5 for inference, 3 for training; 2 with --quick)")
    p.add_argument("--max-scenario-s", type=float, default=25.0,
                   help="cut iterations when one peer/scenario would take longer than this")
    p.add_argument("--offtensor-prefetch", type=int, default=None,
                   help="pass offtensor.Policy(prefetch=N) to wrap (default: the library's default)")
    p.add_argument("--offtensor-max-scope-mib", type=float, default=None,
                   help="pass offtensor.Policy(max_scope_bytes=N MiB) to wrap: split decoder layers "
                        "larger than that into per-child scopes (default: one scope per layer)")
    p.add_argument("--overlap-piece-mib", type=float, default=None,
                   help="offtensor-overlap: bytes per optimizer piece (tuning; default "
                        "offtensor._overlap.STEP_PIECE_BYTES)")
    p.add_argument("--overlap-spare-threads", type=int, default=None,
                   help="offtensor-overlap: CPU threads the optimizer worker leaves free (tuning)")
    p.add_argument("--overlap-variants", nargs="+", default=[], metavar="SPARE:PIECE_MIB",
                   help="offtensor-overlap: worker settings (spare threads:piece MiB) to time in turn "
                        "beside the plain optimizer step (measure_same_time; default: the current one)")
    p.add_argument("--overlap-rounds", type=int, default=3,
                   help="offtensor-overlap: rounds of measure_same_time (default 3)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.scenarios = _names(args.scenarios, list(SCENARIOS), "scenario")
    args.peers = _names(args.peers, PEER_NAMES, "peer")
    if args.warmup is not None and args.warmup < 1:
        p.error("--warmup must be >= 1")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    if args.overlap_rounds < 1:
        p.error("--overlap-rounds must be >= 1")
    variants = []
    for v in args.overlap_variants:
        try:
            spare, mib = v.split(":")
            variants.append((int(spare), int(float(mib) * 2**20)))
        except (ValueError, OverflowError):
            p.error(f"--overlap-variants: {v!r} is not SPARE:PIECE_MIB (e.g. 1:64)")
    args.overlap_variants = variants
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA device")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # events and streams below use the current device
    base = QUICK_SHAPE if args.quick else FULL_SHAPE
    shape = ModelShape(**{**asdict(base), "layers": args.layers or base.layers})
    scenarios = [SCENARIOS[n] for n in SCENARIOS if n in args.scenarios]  # canonical order
    if args.quick:
        scenarios = [_quick(s) for s in scenarios]
    peers = sorted(args.peers, key=lambda n: n != "resident")  # resident first: it is the roofline
    if args.overlap_piece_mib is not None:
        offtensor_overlap.STEP_PIECE_BYTES = int(args.overlap_piece_mib * 2**20)
    if args.overlap_spare_threads is not None:
        offtensor_overlap.SPARE_THREADS = args.overlap_spare_threads

    env = environment(device)
    print(f"bench: {shape} on {env.get('gpu', device)}; torch {env['torch']}", flush=True)

    bw = measure_bandwidth(device, (256 if args.quick else 1024) * 2**20)
    print(f"bench: bandwidth H2D {bw['h2d'] / 1e9:.1f} GB/s, D2H {bw['d2h'] / 1e9:.1f} GB/s"
          + (f", both at once {bw['bidirectional_total'] / 1e9:.1f} GB/s total"
             if bw.get("bidirectional_total") else "") + f" ({bw['method']})", flush=True)

    rows: list[Row] = []
    variant_bytes: dict[str, VariantBytes] = {}
    setups: dict[str, Any] = {}
    extras = Extras()
    scenario_order = [s.name for s in scenarios]
    peer_order = {n: i for i, n in enumerate(peers)}

    def report(interrupted: bool) -> tuple[list[Row], dict[str, dict[str, Any]]]:
        """Sorted rows with rooflines filled in; also (re)writes --json, so a run killed
        part-way still leaves every peer finished so far on disk."""
        table = sorted(rows, key=lambda r: (scenario_order.index(r.scenario), peer_order[r.peer]))
        rooflines = compute_rooflines(table, scenarios, bw, variant_bytes, extras)
        if args.json:
            result = {
                "environment": env,
                "interrupted": interrupted,
                "args": dict(vars(args)),
                "model": {**asdict(shape), "dtype": "bfloat16", "attn_implementation": "sdpa",
                          "variants": {k: asdict(v) for k, v in variant_bytes.items()}},
                "bandwidth": bw,
                "optimizer_speed": extras.optimizer_speed,
                "optimizer_speed_fp32": extras.optimizer_speed_fp32,
                "plain_optimizer": extras.plain_adamw,
                "scenarios": {s.name: {**asdict(s), **rooflines[s.name]} for s in scenarios},
                "setups": setups,
                "results": [asdict(r) for r in table],
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return table, rooflines

    interrupted = False
    try:
        for peer in peers:
            plans = [(s, peer_plan(peer, s)) for s in scenarios]
            plan = [(s, p) for s, p in plans if p is not None]
            if not plan:
                continue  # an offtensor variant whose scenarios were not selected
            why = peer_unavailable(peer)
            if why is not None:
                print(f"bench: {peer}: skipped, {why}", flush=True)
                rows += [Row(s.name, peer, "skipped", why, batch=s.batch, seq=s.seq) for s, _ in plan]
                continue
            rows += [Row(s.name, peer, "skipped", p, batch=s.batch, seq=s.seq) for s, p in plan if p != "run"]
            to_run = [s for s, p in plan if p == "run"]
            if not to_run:
                continue
            print(f"bench: {peer}", flush=True)
            run_peer(peer, to_run, shape, device, args, rows, variant_bytes, setups, extras)
            report(interrupted=False)
    except KeyboardInterrupt:
        # `timeout --signal=INT` in scripts/gpu_check.sh lands here: report what was measured.
        interrupted = True
        print("bench: interrupted; reporting the results so far", flush=True)
        if rows and rows[-1].status == "ok" and rows[-1].median_ms is None:
            rows[-1].status, rows[-1].note = "error", "interrupted"

    table, rooflines = report(interrupted)
    if args.json:
        print(f"bench: wrote {args.json}", flush=True)
    notes = [f"  {r.peer}/{r.scenario}: {r.note}" for r in table if r.note]
    notes += [f"  {s}: {e['note']}" for s, e in rooflines.items() if e.get("note")]
    if notes:
        print("notes:\n" + "\n".join(notes))
    steps = [format_step_breakdown(s, e) for s, e in rooflines.items() if "peers" in e]
    if steps:
        print("step rooflines:\n" + "\n".join(steps))
    for r in table:
        if r.overlap:
            # When each scope's step ran, from backward_and_step's start: the overlap's timeline.
            o = r.overlap
            spans = ", ".join(f"{s['scope'].rsplit('.', 1)[-1]} q{s['queued_ms']:.0f}/b{s['started_ms']:.0f}"
                              f"/s{s['stepped_ms']:.0f}" for s in o["scopes"])
            print(f"overlap timeline {r.scenario} (ms since backward_and_step was called: handed to "
                  "the worker/first piece began/last piece stepped): backward done "
                  f"{o['backward_ms']:.0f}, all done {o['total_ms']:.0f}; worker busy "
                  f"{o['worker_busy_ms']:.0f} ms in {o['pieces']} pieces of <= "
                  f"{o['piece_bytes'] / 2**20:.0f} MiB with {o['spare_threads']} spare threads; "
                  f"{o['rest_params']} params after backward; {o['early_pieces']} pieces handed over "
                  f"before their scope's backward ended; {spans or 'no scope stepped during backward'}")
            entry = rooflines.get(r.scenario, {}).get("peers", {}).get(r.peer, {})
            host = entry.get("host_roofline_ms")
            if host and r.median_ms is not None:
                print(f"  {r.peer}/{r.scenario}: {r.median_ms:.1f} ms = {r.median_ms / host:.2f}x "
                      f"max(fwd+bwd, optimizer beside the step's copies) = {host:.1f} ms")
            if r.same_time:
                print(format_same_time(r, entry.get("fwd_bwd_roofline_ms")))
    for name, speed in (("optimizer_speed", extras.optimizer_speed),
                        ("optimizer_speed_fp32", extras.optimizer_speed_fp32)):
        if speed is not None:
            print(f"{name}: " + (speed["error"] if "error" in speed else
                                 f"fused AdamW {speed['dtype']}, offloaded params "
                                 f"{speed['wrapped_gparams_per_s']:.3g} G params/s vs plain CPU tensors "
                                 f"{speed['plain_gparams_per_s']:.3g} G params/s: ratio {speed['ratio']:.3f} "
                                 f"(target >= {speed['target']})"))
    print()
    print(format_table(table, bw, env, shape, args.quick), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
