"""wrap and unwrap: building a model's scopes and its engine, and taking them apart.

The plan (which modules, which parameters, the layouts, the checks) is made first, in
planning.py, before any parameter moves; then each scope's masters are laid out in its host
buffer and its parameters become OffloadedParameters, one scope at a time. The guards wrap
installs on the model are in guards.py.

# Note [part of a wrapped model]
`is_wrapped`, `summary` and `unwrap` find the engine through an offloaded parameter when the
module is not the one `wrap` was called on: PEFT's `merge_and_unload()` returns the base model
inside the wrapped `PeftModel`, holding the same (now merged) offloaded parameters. `unwrap` of
such a module unwraps the whole wrapped model, and so requires it to hold every scope.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import nn

from ..api import Policy
from ..budget.shared import SharedBudget
from ..dispatch.autograd import give_back_tensor_hooks, take_tensor_hooks
from ..dispatch.device_copies import device_copy
from ..dispatch.eager_step import close_window
from ..dispatch.function_apply import intercept_function_apply
from ..dispatch.masters import master_values, without_subclass_dispatch
from ..dispatch.param import OffloadedParameter
from ..dispatch.slot import ParamSlot
from ..dispatch.wrapper_guards import check_model
from ..engine.engine import ENGINE_ATTR, Engine, engine_of
from ..engine.hooks import ScopeHooks
from ..engine.host_grads import new_host_grad
from ..engine.model_hooks import ModelHooks
from ..formats import RowReader, frozen_format
from ..optim.overlap import wait_for_steps
from ..scopes.experts import route_experts
from ..scopes.scope import Scope
from ..scopes.sources import BufferSource, FileSource, ShadowSource, StagedSource
from ..storage.compress import PackedMaster, StoredMaster, copy_rows
from ..storage.file_masters import FileScope
from ..storage.files import FileStore
from ..storage.memory import HostBuffer, PinnedMemoryError, pinning_available
from ..storage.staging import StagingRing
from .guards import guard, remove_guards
from .planning import (
    Predicate,
    check_budget,
    check_memory_not_shared,
    check_selection,
    compute_dtypes,
    host_sizes,
    layout,
    plan_scopes,
    resolve_device,
    scopes_in_files,
    select,
)
from .progress import Progress
from .quantized import attach, weights_of

logger = logging.getLogger("offtensor")



def wrap(model: nn.Module, predicate: Predicate | None = None, *,
         device: torch.device | str | None = None, policy: Policy | None = None) -> nn.Module:
    """`offtensor.wrap` of an nn.Module (its docstring, in components.py, says what it does)."""
    return wrap_filling(model, predicate, device, policy, source=None)


class ScopeSource(Protocol):
    """Where the masters' values come from when they are not in the model (offtensor.load,
    model/load.py, hands one down): each scope in turn, `begin`, `value` per parameter, `end`."""

    label: str  # for the progress line
    # The files a scope's masters may stay in under Policy(host_budget) (Note [masters in
    # files] in storage/file_masters.py); None: every master goes to host RAM.
    store: FileStore | None

    def begin(self, name: str, params: list[tuple[str, nn.Parameter]]) -> None: ...

    def value(self, qualified_name: str, p: nn.Parameter) -> torch.Tensor | RowReader: ...

    def end(self) -> None: ...


def wrap_filling(model: nn.Module, predicate: Predicate | None, device: torch.device | str | None,
                 policy: Policy | None, source: ScopeSource | None, shared: SharedBudget | None = None) -> nn.Module:
    """`wrap`; with `source`, the masters' values come from it scope by scope, and parameters
    on the meta device are accepted (Note [loading scope by scope] in model/load.py); with
    `shared`, the VRAM budget is shared with other models (Note [one budget across models] in
    budget/shared.py), which lays out once all are wrapped."""
    policy = policy if policy is not None else Policy()
    _check_arguments(model, predicate, policy)
    device = resolve_device(device)
    selected = select(model, predicate, policy)
    check_selection(model, selected, allow_meta=source is not None)
    pin = policy.pin_memory is True or (policy.pin_memory is None and device.type == "cuda")
    if pin and not pinning_available():
        raise ValueError("offtensor.wrap: Policy(pin_memory=True) needs CUDA; this machine has none")
    store = source.store if source is not None else None
    if policy.host_budget is not None and store is None:
        raise ValueError(
            "offtensor.wrap: Policy(host_budget=...) leaves the masters that do not fit in their "
            "safetensors files, so it needs offtensor.load(model, checkpoint, policy=...) on a model "
            "built on the meta device (wrap finds the masters in RAM already)")
    plans = plan_scopes(selected)
    check_memory_not_shared(model, plans)
    check_budget(plans, policy)
    in_files = scopes_in_files(plans, policy)  # Note [masters in files] (storage/file_masters.py)
    engine = Engine(device, policy, shared)
    intercept_function_apply()  # Note [custom autograd Functions] (dispatch/function_apply.py)
    # Unpinned (a CPU device, pin_memory False or "ring"), the masters are only copied.
    label = source.label if source is not None else "pinning host memory" if pin else "copying masters to host memory"
    progress = Progress(sum(p.numel() * p.element_size() for *_, params, _ in plans for _, p in params), label)
    try:
        for name, module, scope_policy, params, block in plans:
            scope = Scope(name, module, scope_policy, engine, pinned=pin and not engine.pinning.failed, block=block)
            if name in in_files:
                assert store is not None
                scope.source, scope.masters.files = FileSource(), FileScope(name, store)
            elif policy.pin_memory == "ring" or (pin and engine.pinning.failed):
                scope.source = _unpinned_source(scope_policy)
            engine.scopes.append(scope)  # before any change, for the undo below
            if source is None:
                _offload_params(scope, params, device)
            else:
                source.begin(name, params)
                _offload_params(scope, params, device, source.value)
                source.end()
            engine.handles.extend(route_experts(scope, engine.expert_cache))  # Note [routed experts] (experts.py)
            progress.advance(sum(p.numel() * p.element_size() for _, p in params))
            hooks = ScopeHooks(scope, engine)
            engine.scope_hooks.append(hooks)
            hooks.install()
            engine.handles.extend(attach(scope))  # after the scope's hooks (Note [quantized weights])
    except BaseException:
        _undo_wrap(engine, model)  # Note [a wrap that raised]
        raise
    finally:
        progress.close()
    _stage(engine, device, policy)
    engine.scopes_ready()
    if not any(scope.module is model for scope in engine.scopes):
        # Not when the model is itself a scope: then the first scope loads when its own
        # forward starts (as when the model is not called: a ModuleList).
        ModelHooks(engine, engine.scope_hooks).install(model)
    guard(model, engine)  # guards.py
    engine.root = weakref.ref(model)
    setattr(model, ENGINE_ATTR, engine)
    logger.debug("wrapped %d scopes (%.1f MiB) computing on %s", len(engine.scopes),
                 sum(s.masters.nbytes for s in engine.scopes) / 2**20, device)
    return model


def _unpinned_source(policy: Policy) -> BufferSource:
    """Where pageable masters go: staged through the ring, unless cast="host" copies from its
    host shadow (Note [page-locked memory as a bounded resource] in storage/memory.py)."""
    return BufferSource(pinned=False) if policy.cast == "host" else StagedSource()


def _stage(engine: Engine, device: torch.device, policy: Policy) -> None:
    """Give the scopes that load through a staging ring (their source a StagedSource, Note [master
    sources] in scopes/sources.py) the ring (Note [staged loads] in storage/staging.py): one per
    model, sized once every scope is laid out, holding the engine weakly."""
    staged = [s for s in engine.scopes if isinstance(s.source, StagedSource)]
    if not staged:
        return
    ref = weakref.ref(engine)

    def upcoming(scope: Scope) -> list[Scope]:
        e = ref()
        return e.upcoming_loads(scope) if e is not None else []

    engine.ring = StagingRing(staged, pin=device.type == "cuda" and policy.pin_memory is not False,
                              slots=2 + policy.prefetch, upcoming=upcoming, pinning=engine.pinning)
    for scope in staged:
        cast(StagedSource, scope.source).ring = engine.ring


def _check_arguments(model: nn.Module, predicate: Predicate | None, policy: Policy) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"offtensor.wrap: expected an nn.Module (the model whose blocks to offload), got "
            f"{type(model).__name__}"
        )
    if predicate is not None and not callable(predicate):
        raise TypeError(
            f"offtensor.wrap: predicate must be callable as predicate(qualified_name, module) -> "
            f"bool | offtensor.Policy, or None for the default; got {type(predicate).__name__}"
        )
    if not isinstance(policy, Policy):
        raise TypeError(f"offtensor.wrap: policy must be an offtensor.Policy, got {type(policy).__name__}")
    check_model(model)  # no DDP or FSDP: Note [data-parallel wrappers] in dispatch/wrapper_guards.py
    if getattr(model, ENGINE_ATTR, None) is not None:
        raise RuntimeError(
            f"offtensor.wrap: this {type(model).__name__} is already wrapped "
            f"({len(getattr(model, ENGINE_ATTR).scopes)} scopes); call offtensor.unwrap(model) "
            "first, then wrap it again with the new predicate or policy"
        )
    already = [(n, p) for n, p in model.named_parameters() if isinstance(p, OffloadedParameter)]
    if already:
        name, p = already[0]
        scope = f" (its scope {p._ot.scope.name!r} there)" if hasattr(p, "_ot") else ""
        raise RuntimeError(
            f"offtensor.wrap: parameter {name!r} is already offloaded by another offtensor.wrap "
            f"call{scope}, on a parent or a submodule of this model, or on another model sharing "
            "the module that holds it; call offtensor.unwrap on that model first. Models sharing "
            "modules are wrapped together: put them in one nn.Module (an nn.ModuleList of both) "
            "and wrap that"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """Undo `wrap`: plain `nn.Parameter`s on the CPU (same objects, data and `.grad` kept),
    hooks removed, device copies freed. The model can then be moved or wrapped again.

    `model` may also be a part of the wrapped model that holds all its scopes, such as the base
    model PEFT's `merge_and_unload()` returns: the whole wrapped model is unwrapped."""
    engine = engine_of(model, "unwrap")
    inside = {id(m) for m in model.modules()}
    outside = [s.name for s in engine.scopes if id(s.module) not in inside]
    if outside:
        root = engine.root()
        raise ValueError(
            f"offtensor.unwrap: this {type(model).__name__} holds "
            f"{len(engine.scopes) - len(outside)} of the {len(engine.scopes)} scopes of a wrapped "
            f"model (not {outside[0]!r}); call offtensor.unwrap on the model that was wrapped"
            + (f" (a {type(root).__name__})" if root is not None else "")
        )
    wait_for_steps()  # a deferred optimizer step may still write the masters
    close_window()  # Note [an eager optimizer step] in dispatch/eager_step.py
    if engine.grads.reducer is not None:  # leave data-parallel mode (distributed/data_parallel.py)
        engine.grads.reducer.close()
    return _undo_wrap(engine, model)


# Note [a wrap that raised]
# `wrap` (and `offtensor.load`, which fills the masters through it) makes one scope's parameters
# offloaded at a time. An error on the way (a checkpoint tensor of the wrong shape, an `init`
# function that raises, out of host memory, Ctrl-C) left the scopes before it offloaded and
# hooked, with no engine on the model: half wrapped. `wrap` and `load` then refused the model
# ("already offloaded"), and after an `unwrap` the scope that failed kept the uninitialized
# values `load` had allocated for it, which a retry of `load` keeps ("parameters not on the meta
# device keep their values"). So a wrap that raises undoes the scopes it built, as `unwrap`
# does, the one that failed included (its `slots` hold the parameters made offloaded so far),
# and `load` puts back on the meta device what was there (`_MetaTensors`).


def _undo_wrap(engine: Engine, model: nn.Module) -> nn.Module:
    """`unwrap` once no step is pending: also the undo of a wrap that raised."""
    for hooks in engine.scope_hooks:  # what interrupted calls left (Note [writes after an interrupt], engine/hooks.py)
        hooks.drop_interrupted()
    engine.live.release_all(force=True)
    if engine.expert_cache is not None:
        engine.expert_cache.clear()
    if engine.ring is not None:
        engine.ring.close()
    for handle in (*engine.handles, *engine.guard_handles):
        handle.remove()
    for hooks in engine.scope_hooks:
        hooks.remove()
    for scope in engine.scopes:
        for weight in weights_of(scope):
            weight.restore()
        without_subclass_dispatch(_restore_params, scope)
    root = engine.root()
    for top in (model, root):
        if top is None:
            continue
        remove_guards(top)
        if getattr(top, ENGINE_ATTR, None) is engine:
            delattr(top, ENGINE_ATTR)
    return model


def _restore_params(scope: Scope) -> None:
    """The scope's parameters become plain nn.Parameters again (subclass dispatch off)."""
    for slot in scope.slots:
        p = slot.param
        grad = p.grad
        data = master_values(p)  # a compressed master: its values, unpacked
        p.grad = None
        del p._ot  # type: ignore[attr-defined]
        p.__class__ = nn.Parameter  # type: ignore[assignment]
        p.data = data
        give_back_tensor_hooks(p, slot)
        if grad is not None:
            p.grad = grad.clone()


def _offload_params(scope: Scope, params: list[tuple[str, nn.Parameter]], device: torch.device,
                    values: Callable[[str, nn.Parameter], torch.Tensor | RowReader] | None = None) -> None:
    """Lay the scope's masters out in its host buffer (or, for a scope in files, `scope.masters.files`:
    Note [masters in files] in storage/file_masters.py) and make each parameter offloaded.
    `values(qualified_name, p)` gives each master's values (offtensor.load reads them from a
    checkpoint); default: the parameter's own."""
    dtypes = compute_dtypes(scope.policy, params)
    fmt = frozen_format(scope.policy.frozen_format) if scope.policy.frozen_format else None
    packs, sizes = host_sizes(scope.policy, params)
    offsets, scope.masters.nbytes = layout(sizes)
    dev_offsets, scope.device.nbytes = layout(
        [p.numel() * dt.itemsize for (_, p), dt in zip(params, dtypes, strict=True)]
    )
    # A compressed master is dequantized on the device: loaded as a cast is (scopes/loading.py).
    scope.compute_dtype_differs = any(dt != p.dtype for (_, p), dt in zip(params, dtypes, strict=True))
    scope.casts = any(packs) or scope.compute_dtype_differs
    # Each master gets a storage of its own in the scope's one host allocation (Note [one
    # storage per master] in storage/memory.py); host_flat spans them all for the bulk copy.
    files = scope.masters.files
    masters = None if files is not None else _host_buffer(scope)
    if masters is not None:
        scope.masters.flat = masters.flat
        scope.masters.buffer = masters
    if scope.casts and scope.policy.cast == "host":  # allocated here, in wrap's order of pinned memory
        scope.source = ShadowSource(scope.engine.pinning.empty(scope.device.nbytes, pin=scope.pinned,
                                                               what="host shadows"), scope.pinned)
    # Allocated here only to create each parameter's device tensor on it; freed below.
    scope.device.flat = torch.empty(scope.device.nbytes, dtype=torch.uint8, device=device)
    # Plain tensors that do not require grad: autograd records none of these copies, without
    # grad mode (Note [interrupts]).
    for (qual, p), offset, dev_offset, dt, pk in zip(params, offsets, dev_offsets, dtypes, packs, strict=True):
        value = p.detach() if values is None else values(qual, p)
        packed: StoredMaster | None = None
        if files is not None:  # Note [masters in files] (storage/file_masters.py)
            packed = files.master(qual, p, offset, fmt if pk else None, value)
            host = packed.placeholder()
        elif pk:
            assert fmt is not None and masters is not None
            packed = PackedMaster.on(masters.tensor, offset, qual, fmt, p.dtype, p.shape)
            packed.pack(value)
            host = packed.placeholder()
        else:
            assert masters is not None
            host = masters.tensor(offset, p.dtype, p.shape)
            copy_rows(host, value)  # a block at a time from a checkpoint (Note [loading scope by scope])
        del value  # a weight read from a checkpoint goes now (Note [loading scope by scope])
        grad = p.grad
        p.grad = None
        grad_hooks, post_hooks = take_tensor_hooks(p)  # Note [gradient hooks registered before wrap]
        leaf, view = device_copy(scope.device.flat, dev_offset, dt, p.shape, p.requires_grad)
        if p.is_meta:  # offtensor.load: `p.data =` cannot change a meta tensor's device
            torch.utils.swap_tensors(p, nn.Parameter(host, requires_grad=p.requires_grad))
        else:
            p.data = host
        p.__class__ = OffloadedParameter
        offloaded = cast(OffloadedParameter, p)
        slot = ParamSlot(param=offloaded, name=qual, scope=scope, offset=offset,
                         device_offset=dev_offset, device_leaf=leaf, device_view=view, master=host,
                         packed=packed)
        slot.grad_hooks = grad_hooks if grad_hooks is not None else slot.grad_hooks
        slot.post_hooks = post_hooks if post_hooks is not None else slot.post_hooks
        offloaded._ot = slot
        slot.hook_device_leaf()
        if grad is not None:
            slot.host_grad = new_host_grad(slot)
            slot.host_grad.copy_(grad.detach())
            p.grad = slot.host_grad
        scope.slots.append(slot)
    scope.device.storage.resize_(0)
    assert scope.offloaded()


def _host_buffer(scope: Scope) -> HostBuffer:
    """The scope's host allocation; pageable, staged through the ring, when pinning fails (Note
    [page-locked memory as a bounded resource] in storage/memory.py)."""
    if scope.pinned:
        try:
            return HostBuffer(scope.masters.nbytes, pin=True)
        except PinnedMemoryError as error:
            scope.engine.pinning(error, "the masters")
            scope.source = _unpinned_source(scope.policy)
    return HostBuffer(scope.masters.nbytes, pin=False)

