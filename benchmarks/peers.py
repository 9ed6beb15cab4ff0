"""The peers: each places a freshly built CPU model for computing on the device, in place;
which scenarios each runs; and the PCIe bytes each offtensor peer's training step moves.
Third-party offloaders are imported inside their setup, so that a missing one is a note."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .measure import GiB, host_rss, peak_rss, reset_peak_rss, short_error
from .model import BuiltModel, materialize
from .scenarios import Scenario
from .shapes import RandomFill, expected_load_s

# Policy(vram_budget=N GiB) peers of the real shapes (--shape; issue 31), each also with fp8 frozen
# weights, and one whose budget holds every scope (`budget_keeping_all`): nothing streams.
VRAM_BUDGETS_GIB = (8, 12, 16)
VRAM_PEERS = (*(f"offtensor-vram{n}{fp8}" for n in VRAM_BUDGETS_GIB for fp8 in ("", "-fp8")), "offtensor-vram-all")
PEER_NAMES = ("resident", "offtensor", "offtensor-overlap", "offtensor-castdev", "offtensor-casthost",
              "offtensor-budget", "offtensor-fp8", "offtensor-int8", "offtensor-capped", *VRAM_PEERS,
              "accelerate", "diffusers")
# --shape's default peers: each run of a real shape must fit in minutes (every load counts).
SHAPE_PEER_NAMES = ("resident", "offtensor", "offtensor-overlap", "offtensor-fp8", "offtensor-capped",
                    "accelerate", "diffusers")


@dataclass(frozen=True)
class PeerOptions:
    """What --offtensor-* passes to `offtensor.Policy`; --compile."""

    offtensor_prefetch: int | None = None
    offtensor_max_scope_mib: float | None = None
    offtensor_vram_budget_gib: float | None = None  # Policy(vram_budget=) for the offtensor peers
    compile: bool = False  # block.compile() on each decoder layer (resident and offtensor peers)
    vram_cap_gib: float = 8.0  # offtensor-capped: torch.cuda.set_per_process_memory_fraction
    # --quick --shape: the real shape's layers' bytes (all of them, the largest), so that each
    # offtensor-vram* budget keeps the same share of the tiny model's layers (`vram_budget`).
    vram_full_shape: tuple[int, int] | None = None


COMPILED_PEERS = ("resident", "offtensor", "offtensor-overlap", "offtensor-castdev", "offtensor-casthost")


_compiler_warm = False


def _cold_compiles() -> None:
    """Each peer compiles from nothing, so that compile times compare (issue 12's target):
    inductor's and AOTAutograd's on-disk and in-process caches off (the second peer would
    otherwise load the first one's kernels), and once per process a throwaway compile first,
    so that importing and starting the compiler is charged to no peer."""
    global _compiler_warm
    import torch._functorch.config
    import torch._inductor.config

    for config, name in ((torch._inductor.config, "fx_graph_cache"), (torch._inductor.config, "fx_graph_remote_cache"),
                         (torch._functorch.config, "enable_autograd_cache")):
        if hasattr(config, name):
            setattr(config, name, False)
    if not _compiler_warm:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.compile(lambda t: (t * 2).sin())(torch.ones(8, device=device))
        _compiler_warm = True


def compile_layers(built: BuiltModel, peer: str) -> str:
    """--compile: `layer.compile()` (inductor) on each decoder layer, after the peer placed the
    model, the same way for the resident model and offtensor; compiling happens in the warm-up
    iterations. Dynamo's caches are reset first (a peer's layers must not count towards the
    recompile limit of another's), and the limit is raised to the layer count: transformers'
    layers differ by `layer_idx`, one compiled graph each."""
    if peer not in COMPILED_PEERS:
        return "not compiled"
    import torch._dynamo

    torch._dynamo.reset()
    _cold_compiles()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(8, 2 * len(built.layers)))
    for layer in built.layers:
        layer.compile()
    return "layer.compile() on each decoder layer"


def peer_plan(peer: str, scenario: Scenario) -> str | None:
    """'run'; or the note of a 'skipped' row; or None: the peer has no row for this scenario
    (the offtensor variants are only different from `offtensor` where they have a row)."""
    if peer in VRAM_PEERS:  # the real shapes only; fp8 compresses frozen weights only
        if not scenario.at_shape:
            return None
        kinds = ("infer", "frozen-step") if peer.endswith("-fp8") else ("infer", "train", "frozen-step")
        return "run" if scenario.kind in kinds else None
    if peer in ("accelerate", "diffusers") and scenario.at_shape:
        return ("not run at --shape sizes: it needs the whole bf16 model built in host memory, "
                "which these shapes are made to avoid")
    if peer == "offtensor-capped":  # embeddings and head offloaded too, under the VRAM cap
        return "run" if scenario.kind == "full" else None
    if peer == "offtensor-overlap":
        return "run" if scenario.kind in ("step", "full") else None
    if peer in ("offtensor-castdev", "offtensor-casthost"):
        return "run" if scenario.kind == "step32" else None
    if peer == "offtensor-budget":
        return "run" if scenario.kind in ("infer", "train") else None
    if peer in ("offtensor-fp8", "offtensor-int8"):  # frozen weights only: inference, LoRA
        return "run" if scenario.kind in ("infer", "frozen", "frozen-step") else None
    if peer == "offtensor":
        return None if scenario.kind == "step32" else "run"  # fp32 masters: the -cast* peers
    if peer in ("accelerate", "diffusers") and scenario.has_optimizer:
        return "no optimizer integration"
    return "run"


def place_outside(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer that is not in `layers` to `device`, in place.

    For peers whose hooks own the layers' placement, where a plain `model.to(device)` would
    pull the offloaded weights onto the device too.
    """
    inside = {id(m) for m in layers.modules()}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in inside:
                continue
            for p in module._parameters.values():
                if p is not None:
                    p.data = p.data.to(device)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)


def _setup_resident(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    if built.fill is not None:  # --shape: allocated and filled on the device, no host copy
        materialize(built.model, device, built.fill)
        return "whole model on the device (built on the meta device, filled there)"
    built.model.to(device)
    return "whole model on the device"


def _offtensor_options(built: BuiltModel, opts: PeerOptions, cast: str | None) -> dict[str, Any]:
    import offtensor

    options: dict[str, Any] = {}
    if opts.offtensor_prefetch is not None:
        options["prefetch"] = opts.offtensor_prefetch
    if opts.offtensor_max_scope_mib is not None:
        options["max_scope_bytes"] = int(opts.offtensor_max_scope_mib * 2**20)
    if opts.offtensor_vram_budget_gib is not None:
        options["vram_budget"] = int(opts.offtensor_vram_budget_gib * 2**30)
    if cast is not None:
        # fp32 masters (and their grads and AdamW state) on the host, bf16 copies on the device.
        options["compute_dtype"] = torch.bfloat16
        options["cast"] = cast
    if built.variant == "lora":
        # Offload the frozen base; the small trainable adapters stay on the device, so nothing
        # but the base weights crosses PCIe (host-to-device only).
        options["param_filter"] = offtensor.frozen_only
    return options


def budget_keeping_half(built: BuiltModel, prefetch: int) -> int:
    """A `Policy.vram_budget` that keeps half the decoder layers resident beside what streaming
    the others needs (2 + prefetch layers; Note [VRAM budget] in budget/vram.py)."""
    layer = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in layer.parameters())
                for layer in built.layers)
    return (len(built.layers) // 2 + 2 + prefetch) * layer


def _scope_bytes(built: BuiltModel, layer: nn.Module) -> int:
    """Device bytes of one layer's offloaded parameters (each rounded up to 256 bytes; a LoRA
    model offloads its frozen base only)."""
    return sum(-(-p.numel() * p.element_size() // 256) * 256 for p in layer.parameters()
               if built.variant != "lora" or not p.requires_grad)


def layer_bytes(built: BuiltModel) -> tuple[int, int]:
    """(all, the largest) of the layers' offloaded device bytes: what a VRAM budget divides."""
    sizes = [_scope_bytes(built, layer) for layer in built.layers]
    return sum(sizes), max(sizes)


def budget_keeping_all(built: BuiltModel, prefetch: int) -> int:
    """A `Policy.vram_budget` that keeps every layer resident: their bytes, the streaming room
    beside them (2 + prefetch of the largest) and 1 MiB; nothing streams after the first load."""
    total, largest = layer_bytes(built)
    return total + (2 + prefetch) * largest + 2**20


def vram_budget(peer: str, built: BuiltModel, opts: PeerOptions) -> int:
    """The `Policy.vram_budget` of an offtensor-vram* peer: N GiB, or every layer's bytes for
    offtensor-vram-all. With `opts.vram_full_shape` (--quick), the budget that keeps the same
    share of this model's layers, beside the streaming room, as N GiB keeps of the real shape's."""
    prefetch = opts.offtensor_prefetch if opts.offtensor_prefetch is not None else 1
    if peer == "offtensor-vram-all":
        return budget_keeping_all(built, prefetch)
    budget = int(peer.removeprefix("offtensor-vram").removesuffix("-fp8")) * GiB
    if opts.vram_full_shape is None:
        return budget
    full_total, full_largest = opts.vram_full_shape
    share = min(1.0, max(0.0, (budget - (2 + prefetch) * full_largest) / full_total))
    total, largest = layer_bytes(built)
    return (2 + prefetch) * largest + int(share * total) + 256


def layers_embeddings_and_head(model: Any, layers: nn.ModuleList) -> Callable[[str, nn.Module], bool]:
    """A wrap predicate selecting each decoder layer, the input embeddings and the head of a
    transformers model (plain nn.Embedding and nn.Linear modules). A head tied to the embeddings
    is not selected: its weight is the embeddings' scope's (wrap would warn that it is)."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    chosen = {id(m) for m in layers} | {id(embeddings)}
    if head is not None and head.weight is not embeddings.weight:
        chosen.add(id(head))

    def predicate(name: str, module: nn.Module) -> bool:
        return id(module) in chosen

    predicate.__name__ = "layers_embeddings_and_head"
    return predicate


def _load(built: BuiltModel, device: torch.device, policy: Any, predicate: Any) -> str:
    """offtensor.load of a --shape model with its RandomFill: scope by scope, never the whole
    model on the host. Prints the load time and the peak host RSS."""
    import offtensor

    assert isinstance(built.fill, RandomFill)
    total = built.total_bytes if predicate is not None else built.wrapped_bytes
    compressed = policy is not None and policy.frozen_format is not None
    built.fill.start(total, total // max(len(built.layers), 1))
    print(f"    loading {total / 1e9:.1f} GB of bf16 weights scope by scope"
          f"{' (compressed to ' + policy.frozen_format + ' on the host)' if compressed else ''}; "
          f"first guess {expected_load_s(total, compressed):.0f} s", flush=True)
    rss0, t0 = host_rss(), time.perf_counter()
    can_peak = reset_peak_rss()
    offtensor.load(built.model, init=built.fill, predicate=predicate, device=device, policy=policy,
                   init_device=built.fill.device)
    load_s = time.perf_counter() - t0
    peak = peak_rss() if can_peak else None
    held = offtensor.summary(built.model).host_bytes
    print(f"    loaded in {load_s:.1f} s: host masters {held / GiB:.2f} GiB, peak host RSS "
          + (f"{peak / GiB:.2f} GiB" if peak is not None else "unknown")
          + (f" (before: {rss0 / GiB:.2f} GiB)" if rss0 is not None else ""), flush=True)
    return f"offtensor.load in {load_s:.1f} s, peak host RSS " + (
        f"{peak / GiB:.2f} GiB" if peak is not None else "unknown")


def setup_offtensor(built: BuiltModel, device: torch.device, opts: PeerOptions, cast: str | None = None,
                    budget: bool = False, frozen_format: str | None = None, offload_all: bool = False,
                    vram_peer: str | None = None) -> str:
    """`offtensor.wrap` with the default predicate (every element of every nn.ModuleList: the
    decoder layers; with `offload_all`, the embeddings and head too), then the rest of the
    model to the device; a --shape model is loaded scope by scope instead (`_load`). With
    `vram_peer`, the Policy.vram_budget of that offtensor-vram* peer (`vram_budget`). Returns the
    call, in words."""
    import offtensor

    options = _offtensor_options(built, opts, cast)
    if budget:
        options["vram_budget"] = budget_keeping_half(built, options.get("prefetch", 1))
    if vram_peer is not None:
        options["vram_budget"] = vram_budget(vram_peer, built, opts)
    if frozen_format is not None:
        # Compressed on the host, dequantized on the device (Note [compressed masters]). Only
        # frozen weights are: this peer runs inference (the base model, frozen here) and LoRA.
        options["frozen_format"] = frozen_format
        if built.variant == "base":
            built.layers.requires_grad_(False)
    policy = offtensor.Policy(**options) if options else None
    predicate = layers_embeddings_and_head(built.model, built.layers) if offload_all else None
    loaded = ""
    if built.fill is not None:
        loaded = "; " + _load(built, device, policy, predicate)
    else:
        offtensor.wrap(built.model, predicate, device=device, policy=policy)
    built.model.to(device)  # embeddings, final norm, head, rotary buffers; masters stay on the host
    shown = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={getattr(v, '__name__', v)}"
                      for k, v in options.items())
    call = "offtensor.load(model, init=RandomFill" if built.fill is not None else "offtensor.wrap(model"
    return (f"{call}{', ' + predicate.__name__ if predicate else ''}, device={str(device)!r}, "
            f"policy=Policy({shown})){loaded}")


def _setup_accelerate(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    from accelerate import cpu_offload

    place_outside(built.model, built.layers, device)
    for layer in built.layers:
        cpu_offload(layer, execution_device=device)
    return "accelerate.cpu_offload on each decoder layer"


def _setup_diffusers(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
    from diffusers.hooks import apply_group_offloading

    use_stream = device.type == "cuda"  # diffusers refuses streams on the CPU
    place_outside(built.model, built.layers, device)
    # Applied per decoder layer: diffusers traces the execution order from the forward of the
    # module it is given, and an nn.ModuleList has no forward, so giving it `layers` would
    # disable prefetching; per layer, each leaf prefetches the next one within the layer.
    for layer in built.layers:
        apply_group_offloading(layer, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=use_stream)
    return f"diffusers apply_group_offloading(leaf_level, use_stream={use_stream}) on each decoder layer"


def _setup_vram(peer: str) -> Callable[[BuiltModel, torch.device, PeerOptions], str]:
    """An offtensor-vram* peer's setup: its Policy.vram_budget, fp8 frozen weights for -fp8."""
    def setup(built: BuiltModel, device: torch.device, opts: PeerOptions) -> str:
        return setup_offtensor(built, device, opts, vram_peer=peer,
                               frozen_format="fp8" if peer.endswith("-fp8") else None)

    return setup


PEER_SETUP: dict[str, Callable[[BuiltModel, torch.device, PeerOptions], str]] = {
    "resident": _setup_resident,
    "offtensor": setup_offtensor,
    "offtensor-overlap": setup_offtensor,  # same placement; the step uses backward_and_step
    "offtensor-castdev": lambda b, d, o: setup_offtensor(b, d, o, cast="device"),
    "offtensor-casthost": lambda b, d, o: setup_offtensor(b, d, o, cast="host"),
    "offtensor-budget": lambda b, d, o: setup_offtensor(b, d, o, budget=True),
    "offtensor-fp8": lambda b, d, o: setup_offtensor(b, d, o, frozen_format="fp8"),
    "offtensor-int8": lambda b, d, o: setup_offtensor(b, d, o, frozen_format="int8"),
    # A full fine-tune under a VRAM cap (run.py applies it): the embeddings and head offloaded
    # as scopes too; the step is backward_and_step.
    "offtensor-capped": lambda b, d, o: setup_offtensor(b, d, o, offload_all=True),
    **{peer: _setup_vram(peer) for peer in VRAM_PEERS},
    "accelerate": _setup_accelerate,
    "diffusers": _setup_diffusers,
}
_PEER_MODULE = {"resident": None, "offtensor": "offtensor", "offtensor-overlap": "offtensor",
                "offtensor-castdev": "offtensor", "offtensor-casthost": "offtensor", "offtensor-budget": "offtensor",
                "offtensor-fp8": "offtensor", "offtensor-int8": "offtensor", "offtensor-capped": "offtensor",
                **dict.fromkeys(VRAM_PEERS, "offtensor"), "accelerate": "accelerate", "diffusers": "diffusers.hooks"}


def peer_unavailable(peer: str) -> str | None:
    """Why `peer` cannot run here, or None."""
    module = _PEER_MODULE[peer]
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001 - not installed, or broken on import
        return f"not available: {short_error(exc)}"
    return None


def skipped_unavailable(peer: str, needs: str, rows: list[Any]) -> bool:
    """If the package of peer `needs` is missing here, mark `rows` (of `peer`) skipped with the
    reason and say so; True if they were."""
    why = peer_unavailable(needs)
    if why is None:
        return False
    for r in rows:
        r.status, r.note = "skipped", why
    print(f"bench: {peer}: skipped, {why}", flush=True)
    return True


STEP_PEERS = {  # step kind -> {peer: (H2D bytes per wrapped byte and pass, optimizer overlapped)}
    "step": {"offtensor": (1.0, False), "offtensor-overlap": (1.0, True)},
    # fp32 masters: cast="device" moves the fp32 bytes, cast="host" the bf16 copy (half).
    "step32": {"offtensor-castdev": (1.0, False), "offtensor-casthost": (0.5, False)},
}


def step_pcie_bytes(built: BuiltModel, scenario: Scenario) -> tuple[int, int]:
    """(host-to-device, device-to-host) bytes of one training step of the standard peer
    (step_roofline): weights in twice (forward, recompute), gradients out once."""
    h2d_per_byte = next(iter(STEP_PEERS[scenario.kind].values()))[0]
    return int(2 * built.wrapped_bytes * h2d_per_byte), built.wrapped_trainable_bytes


def offloaded_bytes(model: nn.Module) -> tuple[int, int]:
    """(host bytes of every scope, of them those of trainable parameters) of a wrapped model:
    what one pass loads (compressed masters count their 1-byte values), and the gradients a
    backward sends home."""
    import offtensor

    trainable = sum(p.numel() * p.element_size() for p in model.parameters()
                    if isinstance(p, offtensor.OffloadedParameter) and p.requires_grad)
    return offtensor.summary(model).host_bytes, trainable

