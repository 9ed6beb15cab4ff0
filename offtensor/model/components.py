"""The public wrap, unwrap, summary and is_wrapped, for an nn.Module (wrapping.py, reporting.py)
and for an object holding several: a diffusers pipeline.

# Note [wrapping a pipeline]
A diffusers pipeline is not an nn.Module: it holds its models as components (`pipe.components`,
with tokenizers and a scheduler beside them); users wrapped each one and then called
`pipe.to("cuda")`. `offtensor.wrap(pipe)` does both: each component is wrapped as a model of its
own (its own engine, schedule and hooks, so each learns its own passes), then every component is
moved with `module.to`, which keeps the masters on the host (what `pipe.to` would do; an object
that is not a pipeline has no `to`). The default leaves whole on the device the components that
hold little (under 1/8 of all the components' bytes: a VAE, a CLIP text encoder), whose blocks
would cost a copy each for bytes that matter little; a predicate, seeing `component.name`
names, selects anything. The components stay the same objects and the pipeline's `__call__`
runs unchanged, so its images equal the unwrapped pipeline's. Under a VRAM budget the wrapped
components share one `SharedBudget` (Note [one budget across models] in budget/shared.py), laid
out once all are wrapped. A wrap that raises part way unwraps the components wrapped so far.
`unwrap(pipe)` unwraps each and moves it back to the one device it was on before, if one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..api import Policy, Summary
from ..budget.shared import SharedBudget
from . import reporting, wrapping
from .planning import Predicate, resolve_device, select

# Under the default predicate, a component is wrapped only when it holds at least 1/SMALL of the
# components' bytes (Note [wrapping a pipeline]).
SMALL = 8
_COMPONENTS_ATTR = "_offtensor_components"


@dataclasses.dataclass
class WrappedComponents:
    """What `wrap` did to an object holding several models, for `unwrap` and `summary`."""

    components: list[tuple[str, nn.Module]]  # every nn.Module component, in the pipeline's order
    wrapped: list[str]  # the names of those wrapped
    devices: dict[str, torch.device | None]  # each one's device before wrap (None: several)
    shared: SharedBudget | None


def wrap(model: Any, predicate: Predicate | None = None, *,
         device: torch.device | str | None = None, policy: Policy | None = None) -> Any:
    """Offload the parameters of selected modules to host memory, streaming them to `device`.

    Each module that `predicate` selects becomes a *scope*: its parameters (recursively) become
    `OffloadedParameter`s whose masters live in one flat host buffer (pinned on CUDA). When the
    scope's forward starts, its parameters are copied to the device as one transfer (the next
    scopes are prefetched on a side stream while it computes); when the forward ends the device
    copy is freed. In backward the scope is loaded again, gradients are copied to the host as
    they are produced and accumulate into `p.grad` on the CPU, so a standard `torch.optim`
    optimizer steps the host masters. Works with `torch.utils.checkpoint` (reentrant or not)
    and Hugging Face `gradient_checkpointing_enable()`. Modules not selected are left alone:
    place them yourself (`model.to(device)` after `wrap` moves them and the buffers and keeps
    the offloaded masters on the host).

    An object that is not an nn.Module (a diffusers `DiffusionPipeline`, or any object whose
    attributes hold several models) is wrapped component by component: its nn.Modules are
    `pipe.components`' (else its attributes');
    each component the predicate selects modules in is wrapped (by default: the components the
    default predicate selects blocks in that hold at least 1/8 of all the components' bytes, as
    a Flux pipeline's transformer and T5; not its VAE or CLIP), and every component is then moved
    to `device` (the wrapped ones' masters stay on the host). The predicate then sees names
    with the component's in front (`"transformer.transformer_blocks.0"`). Under
    `Policy(vram_budget=...)` one budget spans the wrapped components: what to keep is chosen by
    the measured time of a whole pipeline call across them. `unwrap`, `summary` and
    `is_wrapped` take the same object. No `pipe.to(...)` is needed.

    Args:
        model: the model, modified in place (or an object holding several: see above).
            Parameters keep their identity (an optimizer built before `wrap` stays valid);
            their data moves into the host buffers.
        predicate: `predicate(qualified_name, module) -> bool | Policy` selects scopes;
            returning a `Policy` selects the module with that policy. Default: every element of
            every outermost `nn.ModuleList` (the decoder layers of a transformer, the blocks of
            a UNet or a diffusion transformer); lists nested inside a selected element are part
            of it. `offtensor.summary(model)` lists the scopes chosen.
            A selected module's descendants are part of it and must not be selected too.
        device: the compute device. Default: the current CUDA device if available, else
            `"cpu"`; `"cpu"` runs the same mechanism with CPU copies (used to test it).
        policy: options (prefetch depth, keep-for-backward, pinning); default `Policy()`.

    Returns:
        `model`, the same object.

    Example::

        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        offtensor.wrap(model)                      # decoder layers offloaded
        model.to("cuda")                           # embeddings, norm, head on the GPU
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()

        pipe = FluxPipeline.from_pretrained(name, dtype=torch.bfloat16)
        offtensor.wrap(pipe, policy=offtensor.Policy(vram_budget="auto"))   # the rest to the GPU too
        image = pipe("a photo of a cat").images[0]
    """
    if isinstance(model, nn.Module):
        return wrapping.wrap(model, predicate, device=device, policy=policy)
    return _wrap_components(model, predicate, device, policy)


def unwrap(model: Any) -> Any:
    """Undo `wrap`: plain `nn.Parameter`s on the CPU (same objects, data and `.grad` kept),
    hooks removed, device copies freed. The model can then be moved or wrapped again.

    `model` may also be a part of the wrapped model that holds all its scopes, such as the base
    model PEFT's `merge_and_unload()` returns: the whole wrapped model is unwrapped. For an
    object wrapped component by component (a diffusers pipeline), each component is unwrapped
    and moved back to the device it was on before `wrap`."""
    if isinstance(model, nn.Module):
        return wrapping.unwrap(model)
    record = _record(model, "unwrap")
    for name, module in record.components:
        if name in record.wrapped:
            wrapping.unwrap(module)
        before = record.devices[name]
        if before is not None:
            module.to(before)
    delattr(model, _COMPONENTS_ATTR)
    return model


def is_wrapped(model: Any) -> bool:
    """True when `model` holds parameters offloaded by `wrap`: it was wrapped, or it is part of
    a wrapped model (Note [part of a wrapped model]); or an object wrapped component by component."""
    if isinstance(model, nn.Module):
        return reporting.is_wrapped(model)
    return getattr(model, _COMPONENTS_ATTR, None) is not None


def summary(model: Any) -> Summary:
    """What each scope in `model` holds on the host and on the device right now. For an object
    wrapped component by component, every wrapped component's scopes, named with the
    component's name in front, and the shared budget's layout."""
    if isinstance(model, nn.Module):
        return reporting.summary(model)
    record = _record(model, "summary")
    parts = [(name, reporting.summary(module)) for name, module in record.components if name in record.wrapped]
    rows = [dataclasses.replace(row, name=f"{name}.{row.name}") for name, part in parts for row in part.scopes]
    first = parts[0][1]
    return Summary(first.device, rows, first.device_allocated,
                   record.shared.layout() if record.shared is not None else None,
                   staging_bytes=sum(p.staging_bytes for _, p in parts),
                   file_bytes_read=sum(p.file_bytes_read for _, p in parts))


def components_of(obj: Any) -> list[tuple[str, nn.Module]]:
    """The nn.Modules an object holds: a diffusers pipeline's `components`, else its attributes;
    each once."""
    found = getattr(obj, "components", None)
    if isinstance(found, dict):
        items = list(found.items())
    else:
        items = list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    out: list[tuple[str, nn.Module]] = []
    for name, value in items:
        if isinstance(value, nn.Module) and all(value is not m for _, m in out):
            out.append((name, value))
    return out


def _record(model: Any, caller: str) -> WrappedComponents:
    record = getattr(model, _COMPONENTS_ATTR, None)
    if not isinstance(record, WrappedComponents):
        raise ValueError(
            f"offtensor.{caller}: this {type(model).__name__} is not wrapped; call offtensor.wrap on it first")
    return record


def _device_of(module: nn.Module) -> torch.device | None:
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    return devices.pop() if len(devices) == 1 else None


def _component_predicate(name: str, predicate: Predicate) -> Predicate:
    return lambda qual, module: predicate(f"{name}.{qual}" if qual else name, module)


def _chosen(components: list[tuple[str, nn.Module]], predicate: Predicate | None,
            policy: Policy) -> list[tuple[str, nn.Module, Predicate | None]]:
    """The components to wrap, each with its predicate (Note [wrapping a pipeline])."""
    if predicate is not None:
        if not callable(predicate):
            raise TypeError(
                f"offtensor.wrap: predicate must be callable as predicate(qualified_name, module) -> "
                f"bool | offtensor.Policy, or None for the default; got {type(predicate).__name__}")
        chosen: list[tuple[str, nn.Module, Predicate | None]] = []
        for name, module in components:
            pred = _component_predicate(name, predicate)
            if select(module, pred, policy):
                chosen.append((name, module, pred))
        return chosen
    sizes = {name: sum(p.numel() * p.element_size() for p in module.parameters()) for name, module in components}
    total = sum(sizes.values())
    return [(name, module, None) for name, module in components
            if sizes[name] * SMALL >= total and select(module, None, policy)]


def _wrap_components(obj: Any, predicate: Predicate | None, device: torch.device | str | None,
                     policy: Policy | None) -> Any:
    """`wrap` of an object holding several models (Note [wrapping a pipeline])."""
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"offtensor.wrap: policy must be an offtensor.Policy, got {type(policy).__name__}")
    if getattr(obj, _COMPONENTS_ATTR, None) is not None:
        raise RuntimeError(
            f"offtensor.wrap: this {type(obj).__name__} is already wrapped; call offtensor.unwrap on it "
            "first, then wrap it again with the new predicate or policy")
    components = components_of(obj)
    if not components:
        raise TypeError(
            f"offtensor.wrap: expected an nn.Module or an object holding nn.Modules (a diffusers "
            f"pipeline), got {type(obj).__name__}, which holds none (in `components` or its attributes)")
    chosen = _chosen(components, predicate, policy)
    if not chosen:
        raise ValueError(
            f"offtensor.wrap: no component of this {type(obj).__name__} has modules to offload "
            f"(components: {[n for n, _ in components]}); the default wraps the blocks (the elements of the "
            "outermost nn.ModuleLists) of the components holding at least 1/8 of the bytes. Pass "
            "predicate=lambda name, module: ... with names such as 'transformer.transformer_blocks.0', "
            "or wrap a component: offtensor.wrap(pipe.transformer)")
    device = resolve_device(device)
    devices = {name: _device_of(module) for name, module in components}
    if policy.vram_budget is not None and policy.expert_cache is not None:
        raise ValueError(
            f"offtensor.wrap: Policy(expert_cache=...) is not carved from a budget shared by the components of this "
            f"{type(obj).__name__}; wrap the mixture-of-experts component alone (offtensor.wrap(pipe.transformer, "
            "policy=...)) or leave expert_cache out")
    shared = SharedBudget(policy, device) if policy.vram_budget is not None else None
    done: list[nn.Module] = []
    try:
        for _, module, pred in chosen:
            wrapping.wrap_filling(module, pred, device, policy, source=None, shared=shared)
            done.append(module)
        if shared is not None:
            shared.ready()
        for _, module in components:
            module.to(device)
        setattr(obj, _COMPONENTS_ATTR, WrappedComponents(components, [n for n, _, _ in chosen], devices, shared))
    except BaseException:
        for module in done:
            wrapping.unwrap(module)
        raise
    return obj
