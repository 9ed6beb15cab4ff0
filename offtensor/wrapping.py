"""The public entry points: wrap, unwrap, is_wrapped, summary.

# Note [moving a wrapped model]
`model.cuda()`, `.to(device)` and `.half()` reach parameters through `Module._apply`, which
rebinds `param.data` to the converted tensor: that would silently move an offloaded master to
the device (and copy the whole model there). `wrap` therefore gives every module with an
offloaded parameter in its subtree (the wrapped model itself included) an instance-level
`_apply`. It first probes the conversion on an empty tensor of each dtype the subtree's masters
have: a dtype change is refused there, before anything changes, because the masters' dtype fixes
the scope's buffer layout. So is `share_memory()` (a probe that comes back in shared memory):
the masters cannot leave the scope's host buffer, and other processes would train copies of
them. Checking the subtree, not only the module's own parameters, matters:
`Module._apply` converts the children one after the other, so a check per module would raise
only after the modules before it (an embedding, a head) were converted, leaving a model of mixed
dtypes. Device moves then apply to everything else (buffers, unwrapped parameters) while the
guarded module hides the masters of its whole subtree from the conversion, leaving them on the
host: a module that got an offloaded parameter after wrap (a head tied to an offloaded
embedding by `tie_weights()`) has no guard of its own, and `Module._apply` would convert its
master like a plain parameter. (A module that merely contains the wrapped model is not
guarded: converting it may convert its other children before the wrapped model refuses.)

# Note [loading with assign=True]
`load_state_dict(sd, assign=True)` replaces each parameter by the state dict's tensor: offloaded
parameters would become plain ones that no scope loads, in a model that is still wrapped. Each
module with offloaded parameters in its subtree therefore has a load_state_dict pre-hook. When
`assign` is set (PyTorch passes it to `_load_from_state_dict` as
`local_metadata["assign_to_params_buffers"]`), it checks that the state dict's tensors for the
subtree's offloaded parameters have their shapes and dtypes (the outermost module checks before
anything is loaded) and, on a module holding offloaded parameters itself, turns `assign` off:
the values are copied into the masters, and that module's buffers and other parameters are
copied too, as with `assign=False`.

# Note [replacing an offloaded parameter]
`module.weight = nn.Parameter(t)` after wrap, or tying a scope's parameter to another one
(`tie_weights()` on a selected head), would register a plain parameter in the scope, never
offloaded (resident on the device, or PyTorch's device-mismatch error once the inputs are
there), while the old master stayed in the scope's buffer and was still loaded at each call:
the scope's layout is fixed at wrap. A parameter registration hook (`Module.register_parameter`,
which `setattr` uses, calls it for every module) refuses to replace a live offloaded parameter
by another object, before anything changes, naming it and the ways to do it: copy the values
in, or unwrap, change the model and wrap again. Registering the same parameter again, new
parameters (adapters added after wrap, plain ones) and moving one under another name (prune's
`weight_orig`, parametrizations' `original`) are unaffected; so is code that writes
`module._parameters` directly (accelerate's `set_module_tensor_to_device`, which gives a plain
parameter, and torch.func's `functional_call`, which puts the originals back).

# Note [part of a wrapped model]
`is_wrapped`, `summary` and `unwrap` find the engine through an offloaded parameter when the
module is not the one `wrap` was called on: PEFT's `merge_and_unload()` returns the base model
inside the wrapped `PeftModel`, holding the same (now merged) offloaded parameters. `unwrap` of
such a module unwraps the whole wrapped model, and so requires it to hold every scope.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Protocol, cast

import numpy as np
import torch
from torch import nn

from . import patches
from .api import MasterHome, Policy, Residency, ScopeState, ScopeSummary, Summary
from .core import engine as _engine
from .core.engine import Engine
from .core.grads import new_host_grad
from .core.hooks import Hook, ModelHooks, ScopeHooks
from .core.memory import HostBuffer, PinnedMemoryError, PinProgress, pinning_available
from .core.schedule import streaming_bytes
from .core.scope import ALIGN, Scope
from .core.slot import ParamSlot, device_copy, in_backward
from .dispatch.param import OffloadedParameter, intercept_function_apply, master_values, without_subclass_dispatch
from .distributed.wrappers import check_model
from .optim.overlap import wait_for_steps
from .weights.compress import FrozenFormat, PackedMaster, RowReader, StoredMaster, compresses, copy_rows, packed_nbytes
from .weights.file_masters import FileScope, plan_host_budget
from .weights.files import FileStore
from .weights.quantized import attach, offloaded_weight, quant_kind, quantized_parts, weights_of
from .weights.staging import StagingRing

logger = logging.getLogger("offtensor")

Predicate = Callable[[str, nn.Module], "bool | Policy"]
_ENGINE_ATTR = "_offtensor_engine"


def wrap(model: nn.Module, predicate: Predicate | None = None, *,
         device: torch.device | str | None = None, policy: Policy | None = None) -> nn.Module:
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

    Args:
        model: the model, modified in place. Parameters keep their identity (an optimizer built
            before `wrap` stays valid); their data moves into the host buffers.
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
        `model`.

    Example::

        model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
        offtensor.wrap(model)                      # decoder layers offloaded
        model.to("cuda")                           # embeddings, norm, head on the GPU
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
    """
    return wrap_filling(model, predicate, device, policy, source=None)


class ScopeSource(Protocol):
    """Where the masters' values come from when they are not in the model (offtensor.load,
    weights/load.py, hands one down): each scope in turn, `begin`, `value` per parameter, `end`."""

    label: str  # for the progress line
    # The files a scope's masters may stay in under Policy(host_budget) (Note [masters in
    # files] in weights/file_masters.py); None: every master goes to host RAM.
    store: FileStore | None

    def begin(self, name: str, params: list[tuple[str, nn.Parameter]]) -> None: ...

    def value(self, qualified_name: str, p: nn.Parameter) -> torch.Tensor | RowReader: ...

    def end(self) -> None: ...


def wrap_filling(model: nn.Module, predicate: Predicate | None, device: torch.device | str | None,
                 policy: Policy | None, source: ScopeSource | None) -> nn.Module:
    """`wrap`; with `source`, the masters' values come from it scope by scope, and parameters
    on the meta device are accepted (Note [loading scope by scope] in weights/load.py)."""
    policy = policy if policy is not None else Policy()
    _check_arguments(model, predicate, policy)
    device = _resolve_device(device)
    selected = _select(model, predicate, policy)
    _check_selection(model, selected, allow_meta=source is not None)
    pin = policy.pin_memory is True or (policy.pin_memory is None and device.type == "cuda")
    if pin and not pinning_available():
        raise ValueError("offtensor.wrap: Policy(pin_memory=True) needs CUDA; this machine has none")
    store = source.store if source is not None else None
    if policy.host_budget is not None and store is None:
        raise ValueError(
            "offtensor.wrap: Policy(host_budget=...) leaves the masters that do not fit in their "
            "safetensors files, so it needs offtensor.load(model, checkpoint, policy=...) on a model "
            "built on the meta device (wrap finds the masters in RAM already)")
    plans = _plan_scopes(selected)
    _check_memory_not_shared(model, plans)
    _check_budget(plans, policy)
    in_files = _plan_host_budget(plans, policy)  # Note [masters in files] (weights/file_masters.py)
    engine = Engine(device, policy)
    intercept_function_apply()  # Note [custom autograd Functions] (dispatch/param.py)
    progress = PinProgress(sum(p.numel() * p.element_size() for *_, params, _ in plans for _, p in params),
                           *([source.label] if source is not None else []))
    try:
        for name, module, scope_policy, params, block in plans:
            scope = Scope(name, module, scope_policy, engine, pinned=pin and not engine.pinning.failed, block=block)
            if name in in_files:
                assert store is not None
                scope.home, scope.files = MasterHome.FILE, FileScope(name, store)
            elif policy.pin_memory == "ring" or (pin and engine.pinning.failed):
                scope.home = _unpinned_home(scope_policy)
            engine.scopes.append(scope)  # before any change, for the undo below
            if source is None:
                _offload_params(scope, params, device)
            else:
                source.begin(name, params)
                _offload_params(scope, params, device, source.value)
                source.end()
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
    _guard_model_ops(model, engine)
    engine.root = weakref.ref(model)
    setattr(model, _ENGINE_ATTR, engine)
    logger.debug("wrapped %d scopes (%.1f MiB) computing on %s", len(engine.scopes),
                 sum(s.nbytes for s in engine.scopes) / 2**20, device)
    return model


def _unpinned_home(policy: Policy) -> MasterHome:
    """Where pageable masters go: staged through the ring, unless cast="host" copies from its
    host shadow (Note [page-locked memory as a bounded resource] in core/memory.py)."""
    return MasterHome.PAGEABLE if policy.cast == "host" else MasterHome.RING


def _plan_host_budget(plans: list[_Plan], policy: Policy) -> set[str]:
    """The scopes whose masters stay in files under Policy(host_budget) (Note [masters in
    files] in weights/file_masters.py)."""
    if policy.host_budget is None:
        return set()
    scopes = [(name, _layout(_host_sizes(scope_policy, params)[1])[1],
               [qual for qual, p in params if p.requires_grad])
              for name, _, scope_policy, params, _ in plans]
    return plan_host_budget(scopes, policy.host_budget)


def _stage(engine: Engine, device: torch.device, policy: Policy) -> None:
    """Give the scopes that load through a staging ring theirs (Note [staged loads] in
    weights/file_masters.py): one per model, holding the engine weakly."""
    staged = [s for s in engine.scopes if s.home in (MasterHome.RING, MasterHome.FILE)]
    if not staged:
        return
    ref = weakref.ref(engine)

    def upcoming(scope: Scope) -> list[Scope]:
        e = ref()
        return e.upcoming_loads(scope) if e is not None else []

    engine.ring = StagingRing(staged, pin=device.type == "cuda" and policy.pin_memory is not False,
                              slots=2 + policy.prefetch, upcoming=upcoming, pinning=engine.pinning)
    for scope in staged:
        scope.ring = engine.ring


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
    check_model(model)  # no DDP or FSDP: Note [data-parallel wrappers] in distributed/wrappers.py
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise RuntimeError(
            f"offtensor.wrap: this {type(model).__name__} is already wrapped "
            f"({len(getattr(model, _ENGINE_ATTR).scopes)} scopes); call offtensor.unwrap(model) "
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


_Plan = tuple[str, nn.Module, Policy, list[tuple[str, nn.Parameter]], str]


def _plan_scopes(selected: list[tuple[str, nn.Module, Policy]]) -> list[_Plan]:
    """(name, module, policy, its parameters to offload, block) per scope to build; a parameter
    shared by several selected modules goes to the first."""
    owner: dict[int, str] = {}  # id(parameter) -> the scope that offloads it
    plans = []
    for name, module, scope_policy, recurse, block in _split_large(selected):
        params, tied = [], []
        for pname, p in module.named_parameters(recurse=recurse):
            qual = f"{name}.{pname}" if name else pname
            if id(p) in owner:
                tied.append((qual, owner[id(p)]))
            elif scope_policy.param_filter is None or _keep(scope_policy, qual, p):
                owner[id(p)] = name
                # A quantized weight: its inner tensors instead (Note [quantized weights]).
                params.extend(quantized_parts(qual, p) if quant_kind(p) is not None else [(qual, p)])
        if params:
            plans.append((name, module, scope_policy, params, block))
        elif tied and name == block:
            qual, other = tied[0]
            warnings.warn(
                f"offtensor.wrap: the predicate selected {name or '<root>'!r}, but its parameters "
                f"are all tied to parameters of scope {other or '<root>'!r} (e.g. {qual!r}), "
                f"which offloads them: {name or '<root>'!r} is not a scope of its own, and its "
                "Policy (keep_for_backward, ...) does not apply. Select only one of the two, or "
                "untie the weights",
                stacklevel=3,
            )
    if not plans:
        raise ValueError(
            f"offtensor.wrap: the predicate selected {len(selected)} modules (e.g. "
            f"{selected[0][0]!r}) but Policy.param_filter kept none of their parameters; with "
            "offtensor.frozen_only, freeze the base weights (requires_grad_(False), or "
            "peft.get_peft_model) before wrapping"
        )
    return plans


# Note [parameters sharing memory]
# Each offloaded parameter gets a master of its own in its scope's host buffer. A parameter
# whose memory overlaps another tensor of the model (one is a view of the other, a buffer that
# is a view of a weight) shares it no longer after wrap: the optimizer's updates of one do not
# reach the other, where in the plain model they do. That would train silently differently, so
# wrap refuses it, naming both. Parameters that merely slice one tensor without overlapping
# (disjoint or interleaved rows) are independent anyway and are accepted: the check compares
# the bytes each tensor covers, exactly, when their byte ranges overlap. Tensors outside the
# model (the `base` a parameter was cut from) cannot be seen.
def _check_memory_not_shared(model: nn.Module, plans: list[_Plan]) -> None:
    offloaded = {id(p) for *_, params, _ in plans for _, p in params}
    by_storage: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor]]] = {}
    named = (*model.named_parameters(), *model.named_buffers())
    order = {name: i for i, (name, _) in enumerate(named)}  # the error names them in this order
    for name, t in named:
        if type(t) not in (nn.Parameter, torch.Tensor, nn.Buffer) or t.is_meta or t.numel() == 0:
            continue  # a quantized weight's inner tensors are checked as its parts are not
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((name, t))
    for tensors in by_storage.values():
        # By first byte, each compared only with those before it not ended yet: a checkpoint
        # loaded by slicing one storage puts every weight in one list.
        tensors.sort(key=lambda named: _byte_span(named[1])[0])
        active: list[tuple[str, torch.Tensor]] = []
        for name, t in tensors:
            start = _byte_span(t)[0]
            active = [(n, o) for n, o in active if _byte_span(o)[1] > start]
            for other_name, other in active:
                if (id(t) in offloaded or id(other) in offloaded) and _overlap(t, other):
                    first, second = sorted((name, other_name), key=order.__getitem__)
                    raise ValueError(
                        f"offtensor.wrap: {first!r} and {second!r} share memory (one is a "
                        "view of the other, or both of one tensor); an offloaded parameter gets "
                        "a master of its own, so writes to one (optimizer steps) would no longer "
                        "reach the other. Make them separate tensors (nn.Parameter(t.clone())), "
                        "or keep one parameter and take the view in forward"
                    )
            active.append((name, t))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b, on one storage, have a byte in common."""
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    if a_end <= b_start or b_end <= a_start:
        return False
    start = min(a_start, b_start)
    marks = torch.zeros(max(a_end, b_end) - start, dtype=torch.uint8)
    _bytes_of(marks, a, start).fill_(1)
    return bool(_bytes_of(marks, b, start).any())


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The first byte of t in its storage and the byte after its last."""
    size = t.element_size()
    first = int(t.storage_offset()) * size
    return first, first + size * (1 + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True)))


def _bytes_of(marks: torch.Tensor, t: torch.Tensor, start: int) -> torch.Tensor:
    """The bytes of `marks` (which begins at byte `start` of t's storage) that t covers."""
    size = t.element_size()
    return marks.as_strided((*t.shape, size), (*(s * size for s in t.stride()), 1),
                            t.storage_offset() * size - start)


def unwrap(model: nn.Module) -> nn.Module:
    """Undo `wrap`: plain `nn.Parameter`s on the CPU (same objects, data and `.grad` kept),
    hooks removed, device copies freed. The model can then be moved or wrapped again.

    `model` may also be a part of the wrapped model that holds all its scopes, such as the base
    model PEFT's `merge_and_unload()` returns: the whole wrapped model is unwrapped."""
    engine = _engine_of(model, "unwrap")
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
    engine.release_all(force=True)
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
        for module in top.modules():
            guard = module.__dict__.get("_apply")
            if isinstance(guard, functools.partial) and guard.func is _apply_keeping_masters:
                del module.__dict__["_apply"]
        if getattr(top, _ENGINE_ATTR, None) is engine:
            delattr(top, _ENGINE_ATTR)
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
        if grad is not None:
            p.grad = grad.clone()


def is_wrapped(model: nn.Module) -> bool:
    """True when `model` holds parameters offloaded by `wrap`: it was wrapped, or it is part of
    a wrapped model (Note [part of a wrapped model])."""
    return _find_engine(model) is not None


def summary(model: nn.Module) -> Summary:
    """What each scope in `model` holds on the host and on the device right now."""
    engine = _engine_of(model, "summary")
    inside = {id(m) for m in model.modules()}
    rows = [
        ScopeSummary(s.name, s.state, s.num_params(), s.host_bytes(), s.device_bytes(), s.loads,
                     s.loads_on_demand, kept=s.residency is Residency.KEPT,
                     carried=s.residency is Residency.CARRIED, masters=s.home,
                     file_bytes=s.nbytes if s.home is MasterHome.FILE else 0)
        for s in engine.scopes if id(s.module) in inside
    ]
    allocated = torch.cuda.memory_allocated(engine.device) if engine.streams.is_cuda else None
    ring = engine.ring
    return Summary(str(engine.device), rows, allocated, engine.schedule.layout(timed=engine.timer is not None),
                   staging_bytes=ring.nbytes if ring is not None else 0,
                   file_bytes_read=ring.bytes_read if ring is not None else 0)


def set_prefetch(model: nn.Module, module: nn.Module, *, forward: list[nn.Module] | None = None,
                 backward: list[nn.Module] | None = None) -> None:
    """Say which modules to load when `module`'s forward (backward) starts, instead of the
    next ones of the order offtensor learned (Note [prefetch order]).

    The learned order is right for a model that runs its blocks in the same order every step;
    when it does not (a block chosen at run time, a mixture of experts, a loop whose length
    changes), the caller knows better. Prefetching is explicit then: exactly the listed
    modules are loaded, without the `Policy.prefetch` budget, so list only what fits on the
    device next to what is computing.

    Args:
        model: the wrapped model.
        module: a module the predicate selected (with `Policy.max_scope_bytes`, the override
            applies to each of its scopes); any other module stands for the scopes holding
            its offloaded parameters.
        forward: the modules to load when `module`'s forward starts; `[]` loads none; `None`
            (the default) goes back to the learned order.
        backward: the same, when `module`'s backward is about to run (their existing
            gradients are fetched too, for accumulation).

    Example::

        blocks = model.model.layers
        for i, block in enumerate(blocks):
            offtensor.set_prefetch(model, block, forward=list(blocks[i + 1 : i + 3]),
                                   backward=list(blocks[max(i - 2, 0) : i])[::-1])
    """
    engine = _engine_of(model, "set_prefetch")
    triggers = _scopes_of(engine, model, module, "module")
    for override, targets in ((engine.schedule.forward_override, forward),
                              (engine.schedule.backward_override, backward)):
        chosen = None if targets is None else [
            s for i, m in enumerate(targets) for s in _scopes_of(engine, model, m, f"forward/backward[{i}]")]
        for scope in triggers:
            if chosen is None:
                override.pop(scope, None)
            else:
                override[scope] = [s for s in chosen if s is not scope]


def _scopes_of(engine: Engine, model: nn.Module, module: nn.Module, what: str) -> list[Scope]:
    """The scopes that hold `module`'s offloaded parameters (a block split in several: all)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"offtensor.set_prefetch: {what} must be an nn.Module, got {type(module).__name__}")
    ids = {id(p) for p in module.parameters()}
    scopes = [s for s in engine.scopes if s.module is module or any(id(slot.param) in ids for slot in s.slots)]
    if not scopes:
        names = {id(m): n for n, m in model.named_modules()}
        where = f"{names[id(module)]!r}" if id(module) in names else "not part of the model"
        raise ValueError(
            f"offtensor.set_prefetch: {what} ({type(module).__name__}, {where}) holds no "
            f"offloaded parameter; name modules the predicate selected "
            f"(offtensor.summary(model) lists the scopes, e.g. {engine.scopes[0].name!r})"
        )
    return scopes


def _find_engine(model: nn.Module) -> Engine | None:
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is not None:
        return engine
    for p in model.parameters():
        slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
        if slot is not None:
            return slot.scope.engine
    return None


def _engine_of(model: nn.Module, caller: str) -> Engine:
    engine = _find_engine(model)
    if engine is None:
        raise ValueError(
            f"offtensor.{caller}: this {type(model).__name__} is not wrapped (it holds no "
            "offloaded parameter); call offtensor.wrap(model) first"
        )
    return engine


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("offtensor.wrap: device='cuda' requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"offtensor.wrap: device {device} is not supported; use 'cuda' or 'cpu'")
    return device


def _select(model: nn.Module, predicate: Predicate | None, policy: Policy) -> list[tuple[str, nn.Module, Policy]]:
    selected: list[tuple[str, nn.Module, Policy]] = []
    if predicate is None:
        # The outermost lists only: a list inside a selected element (T5's `block.N.layer`,
        # diffusers' `attn.to_out`, a UNet block's `resnets`) is part of that element's scope.
        inside: list[str] = []  # prefixes of the selected elements
        for name, module in model.named_modules():
            if not isinstance(module, nn.ModuleList) or any(name.startswith(p) for p in inside):
                continue
            for i, child in enumerate(module):
                child_name = f"{name}.{i}" if name else str(i)
                inside.append(child_name + ".")
                if all(child is not m for _, m, _ in selected):  # a block listed twice: one scope
                    selected.append((child_name, child, policy))
        return selected
    for name, module in model.named_modules():
        choice = predicate(name, module)
        if isinstance(choice, Policy):
            selected.append((name, module, choice))
        elif not isinstance(choice, (bool, np.bool_)):
            raise TypeError(
                f"offtensor.wrap: the predicate returned {type(choice).__name__} for module "
                f"{name or '<root>'!r} ({type(module).__name__}); it must return a bool (True "
                "selects the module) or an offtensor.Policy (selects it with those options). "
                "For a regular expression, return `re.fullmatch(...) is not None`"
            )
        elif choice:
            selected.append((name, module, policy))
    return selected


def _keep(policy: Policy, qual: str, p: nn.Parameter) -> bool:
    assert policy.param_filter is not None
    keep = policy.param_filter(qual, p)
    if not isinstance(keep, (bool, np.bool_)):
        raise TypeError(
            f"offtensor.wrap: Policy.param_filter returned {type(keep).__name__} for parameter "
            f"{qual!r}; it must return a bool (True offloads the parameter)"
        )
    return bool(keep)


def _split_large(selected: list[tuple[str, nn.Module, Policy]]) -> list[tuple[str, nn.Module, Policy, bool, str]]:
    """Apply Policy.max_scope_bytes: (name, module, policy, recurse, block) per scope to build,
    where recurse=False means the module's direct parameters only (its children are scopes too)
    and `block` names the selected module the scope comes from."""
    out: list[tuple[str, nn.Module, Policy, bool, str]] = []

    def visit(name: str, module: nn.Module, policy: Policy, block: str) -> None:
        limit = policy.max_scope_bytes
        children = list(module.named_children())
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        # Note [splitting containers]
        # A scope loads when its module's forward starts. A container without a forward
        # (ModuleList, ModuleDict: a UNet block's `upsamplers`) is never called, so as a scope
        # it never loaded, and every op on its weights made a temporary copy of its own. Its
        # elements, which are called, become the scopes instead, whatever its size.
        never_called = type(module).forward is nn.Module.forward
        if limit is None or (nbytes <= limit and not never_called) or not children:
            out.append((name, module, policy, True, block))
            return
        out.append((name, module, policy, False, block))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child, policy, block)

    for name, module, policy in selected:
        visit(name, module, policy, name)
    return out


def _check_selection(model: nn.Module, selected: list[tuple[str, nn.Module, Policy]], *,
                     allow_meta: bool = False) -> None:
    if not selected:
        raise ValueError(
            f"offtensor.wrap: the predicate selected no module of this {type(model).__name__}. "
            "The default selects each element of every outermost nn.ModuleList; pass "
            "predicate=lambda name, module: ... returning True for the blocks to offload "
            f"(top-level children: {[n for n, _ in model.named_children()]})"
        )
    by_module = {id(m): n for n, m, _ in selected}
    for name, module, _ in selected:
        for sub in module.modules():
            if sub is not module and id(sub) in by_module:
                raise ValueError(
                    f"offtensor.wrap: the predicate selected both {name or '<root>'!r} and its "
                    f"submodule {by_module[id(sub)]!r}; a scope includes its submodules, so "
                    "select only one of them"
                )
        for pname, p in module.named_parameters():
            if p.is_meta and not allow_meta:
                qual = f"{name}.{pname}" if name else pname
                raise ValueError(
                    f"offtensor.wrap: parameter {qual!r} is on the meta device (no data). Use "
                    "offtensor.load(model, weights=checkpoint_dir) to fill a meta model scope by "
                    "scope, or load real weights before wrapping (model.to_empty(device='cpu') "
                    "and load_state_dict(...), or from_pretrained without device_map='meta')"
                )
            if isinstance(p, nn.parameter.UninitializedParameter):
                qual = f"{name}.{pname}" if name else pname
                raise ValueError(
                    f"offtensor.wrap: parameter {qual!r} is uninitialized (lazy module); run one forward first"
                )


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


def _compute_dtypes(policy: Policy, params: list[tuple[str, nn.Parameter]]) -> list[torch.dtype]:
    compute_dtype = policy.compute_dtype
    return [compute_dtype if compute_dtype is not None and p.is_floating_point() else p.dtype for _, p in params]


def _check_budget(plans: list[_Plan], policy: Policy) -> None:
    """Policy.vram_budget must leave room for streaming (Note [VRAM budget] in core/schedule.py);
    checked before any parameter moves, with the layout the scopes will have."""
    budget = policy.vram_budget
    if budget is None or budget == "auto":
        return
    blocks: dict[str, int] = {}
    for _, _, scope_policy, params, block in plans:
        dtypes = _compute_dtypes(scope_policy, params)
        sizes = [p.numel() * dt.itemsize for (_, p), dt in zip(params, dtypes, strict=True)]
        blocks[block] = blocks.get(block, 0) + _layout(sizes)[1]
    total, largest = sum(blocks.values()), max(blocks.values())
    streaming = streaming_bytes(largest, policy.prefetch)
    if budget < min(total, streaming):
        raise ValueError(
            f"offtensor.wrap: Policy(vram_budget={budget}) ({_size(budget)}) is below what "
            f"streaming needs, {_size(streaming)}: {2 + policy.prefetch} times the largest selected "
            f"module ({_size(largest)}), the one computing, the one before it finishing its "
            f"backward and Policy.prefetch={policy.prefetch} in flight. Raise the budget, lower "
            f"prefetch, or select smaller modules (the wrapped weights take {_size(total)} in all)"
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _host_sizes(policy: Policy, params: list[tuple[str, nn.Parameter]]) -> tuple[list[bool], list[int]]:
    """Which masters are stored compressed under Policy(frozen_format) (Note [compressed
    masters]), and each master's host bytes."""
    fmt = FrozenFormat(policy.frozen_format) if policy.frozen_format else None
    packs = [compresses(fmt, p) for _, p in params]
    return packs, [packed_nbytes(p.shape, p.dtype) if pk else p.numel() * p.element_size()
                   for (_, p), pk in zip(params, packs, strict=True)]


def _offload_params(scope: Scope, params: list[tuple[str, nn.Parameter]], device: torch.device,
                    values: Callable[[str, nn.Parameter], torch.Tensor | RowReader] | None = None) -> None:
    """Lay the scope's masters out in its host buffer (or, for a scope in files, `scope.files`:
    Note [masters in files] in weights/file_masters.py) and make each parameter offloaded.
    `values(qualified_name, p)` gives each master's values (offtensor.load reads them from a
    checkpoint); default: the parameter's own."""
    dtypes = _compute_dtypes(scope.policy, params)
    fmt = FrozenFormat(scope.policy.frozen_format) if scope.policy.frozen_format else None
    packs, sizes = _host_sizes(scope.policy, params)
    offsets, scope.nbytes = _layout(sizes)
    dev_offsets, scope.device_nbytes = _layout(
        [p.numel() * dt.itemsize for (_, p), dt in zip(params, dtypes, strict=True)]
    )
    # A compressed master is dequantized on the device: loaded as a cast is (Scope._convert).
    scope.casts = any(packs) or any(dt != p.dtype for (_, p), dt in zip(params, dtypes, strict=True))
    # Each master gets a storage of its own in the scope's one host allocation (Note [one
    # storage per master] in core/memory.py); host_flat spans them all for the bulk copy.
    files = scope.files
    masters = None if files is not None else _host_buffer(scope)
    if masters is not None:
        scope.host_flat = masters.flat
        scope.host_buffer = masters
    if scope.casts and scope.policy.cast == "host":
        scope.host_shadow = scope.engine.pinning.empty(scope.device_nbytes, pin=scope.pinned, what="host shadows")
    # Allocated here only to create each parameter's device tensor on it; freed below.
    scope.device_flat = torch.empty(scope.device_nbytes, dtype=torch.uint8, device=device)
    # Plain tensors that do not require grad: autograd records none of these copies, without
    # grad mode (Note [interrupts]).
    for (qual, p), offset, dev_offset, dt, pk in zip(params, offsets, dev_offsets, dtypes, packs, strict=True):
        value = p.detach() if values is None else values(qual, p)
        packed: StoredMaster | None = None
        if files is not None:  # Note [masters in files] (weights/file_masters.py)
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
        leaf, view = device_copy(scope.device_flat, dev_offset, dt, p.shape, p.requires_grad)
        if p.is_meta:  # offtensor.load: `p.data =` cannot change a meta tensor's device
            torch.utils.swap_tensors(p, nn.Parameter(host, requires_grad=p.requires_grad))
        else:
            p.data = host
        p.__class__ = OffloadedParameter
        offloaded = cast(OffloadedParameter, p)
        slot = ParamSlot(param=offloaded, name=qual, scope=scope, offset=offset,
                         device_offset=dev_offset, device_leaf=leaf, device_view=view, master=host,
                         packed=packed)
        offloaded._ot = slot
        slot.hook_device_leaf()
        if grad is not None:
            slot.host_grad = new_host_grad(slot)
            slot.host_grad.copy_(grad.detach())
            p.grad = slot.host_grad
        scope.slots.append(slot)
    scope.device_storage.resize_(0)
    scope.state = ScopeState.OFFLOADED


def _host_buffer(scope: Scope) -> HostBuffer:
    """The scope's host allocation; pageable, staged through the ring, when pinning fails (Note
    [page-locked memory as a bounded resource] in core/memory.py)."""
    if scope.pinned:
        try:
            return HostBuffer(scope.nbytes, pin=True)
        except PinnedMemoryError as error:
            scope.engine.pinning(error, "the masters")
            scope.home = _unpinned_home(scope.policy)
    return HostBuffer(scope.nbytes, pin=False)


def _refuse_replacing(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Global parameter registration hook: see Note [replacing an offloaded parameter]."""
    old = module._parameters.get(name)
    if old is param or not isinstance(old, OffloadedParameter) or getattr(old, "_ot", None) is None:
        return
    slot = old._ot
    raise RuntimeError(
        f"offtensor: cannot replace offloaded parameter {slot.name!r} of scope "
        f"{slot.scope.name!r} by another {type(param).__name__} after offtensor.wrap: the new one "
        "would not be offloaded, and the old master would still be loaded; nothing was changed. "
        f"To change its values, copy them in (with torch.no_grad(): module.{name}.copy_(new), "
        "same shape and dtype); to change its shape or tie it to another parameter, call "
        "offtensor.unwrap(model), change the model, then wrap it again"
    )


def _guard_model_ops(model: nn.Module, engine: Engine) -> None:
    """Guard `_apply` (Note [moving a wrapped model]) and `load_state_dict(assign=True)` (Note
    [loading with assign=True]) on each module with offloaded parameters in its subtree, and
    parameter registrations everywhere (Note [replacing an offloaded parameter])."""
    patches.parameter_registration_hook(_refuse_replacing)  # once per process: it checks every module
    for module in model.modules():
        if any(isinstance(p, OffloadedParameter) or offloaded_weight(p) for p in module.parameters()):
            module._apply = functools.partial(_apply_keeping_masters, module)  # type: ignore[method-assign]
            engine.guard_handles.append(module.register_load_state_dict_pre_hook(Hook(_load_into_masters)))


def _offloaded_in(module: nn.Module, recurse: bool = True) -> list[tuple[str, OffloadedParameter]]:
    """The offloaded parameters of `module` (with `recurse`, of its subtree), by state dict key;
    a tied parameter once per key."""
    return [(name, p) for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False)
            if isinstance(p, OffloadedParameter) and getattr(p, "_ot", None) is not None]


def _dtype_of(p: torch.Tensor) -> torch.dtype:
    return p.dtype


def _shape_dtype_of(p: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return p.shape, p.dtype


def _apply_keeping_masters(module: nn.Module, fn, recurse: bool = True):
    """Module._apply that refuses dtype changes of offloaded masters before converting anything
    and leaves the masters alone; see Note [moving a wrapped model]."""
    first_of_dtype: dict[torch.dtype, str] = {}
    for _, p in _offloaded_in(module, recurse):
        first_of_dtype.setdefault(without_subclass_dispatch(_dtype_of, p), p._ot.name)
    for q in module.parameters(recurse=recurse):
        weight = offloaded_weight(q)  # its logical dtype (Note [quantized weights])
        if weight is not None:
            first_of_dtype.setdefault(q.dtype, weight.name)
    for dtype, name in first_of_dtype.items():
        try:
            probe = fn(torch.empty(0, dtype=dtype))
        except (RuntimeError, AssertionError, TypeError, ValueError):
            # fn does not apply to a CPU probe: a move to a device this machine lacks
            # (torch raises AssertionError when it was built without CUDA), a custom fn
            continue
        if isinstance(probe, torch.Tensor) and probe.device.type == "cpu" and probe.is_shared():
            # `model.share_memory()`: hidden from the conversion below, the masters would stay
            # private to this process, and processes that fork after it (Hogwild) would each
            # train a copy of their own, silently.
            raise RuntimeError(
                f"offtensor: cannot move offloaded parameter {name!r} to shared memory "
                "(model.share_memory()): the masters of a wrapped model stay in their scopes' host "
                "buffers, so nothing was moved. For several processes, use "
                "offtensor.data_parallel(model, shard_optimizer=True), whose ranks share one host "
                "copy; or call offtensor.unwrap(model) first"
            )
        if isinstance(probe, torch.Tensor) and probe.dtype != dtype:
            raise TypeError(
                f"offtensor: cannot convert offloaded parameter {name!r} from {dtype} "
                f"to {probe.dtype}: the masters of a wrapped model keep their dtype, so nothing "
                "was converted. Convert before offtensor.wrap(model), wrap with "
                f"offtensor.Policy(compute_dtype={probe.dtype}) to compute in it from these "
                "masters (for transformers' Trainer: instead of bf16_full_eval/fp16_full_eval), "
                "or call offtensor.unwrap(model) first. (Device moves such as "
                "model.to('cuda') are fine: they leave the masters on the host.)"
            )
    # The whole subtree's masters, not only the module's own: a module given an offloaded
    # parameter after wrap (a head tied to an offloaded embedding by tie_weights(), a Linear
    # rebuilt around its weight) has no guard of its own.
    masters = [(m._parameters, k, p) for m in (module.modules() if recurse else (module,))
               for k, p in m._parameters.items()
               if isinstance(p, OffloadedParameter) or offloaded_weight(p) is not None]
    for params, key, _ in masters:
        params[key] = None
    try:
        return type(module)._apply(module, fn, recurse)
    finally:
        for params, key, master in masters:
            params[key] = master


def _load_into_masters(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                       *args: object) -> None:
    """load_state_dict pre-hook: with `assign=True`, check the offloaded parameters' entries and
    copy them into the masters instead (Note [loading with assign=True])."""
    if torch.__future__.get_swap_module_params_on_conversion():
        # Module._load_from_state_dict would swap each parameter object's contents for the state
        # dict's tensor: the offloaded parameters would become plain ones (on the state dict's
        # device) that no scope loads, silently.
        loaded = [name for name, _ in _offloaded_in(module) if prefix + name in state_dict]
        if loaded:
            raise RuntimeError(
                f"offtensor: load_state_dict under "
                f"torch.__future__.set_swap_module_params_on_conversion(True) would swap "
                f"offloaded parameter {prefix + loaded[0]!r} for the state dict's tensor, which "
                "ends its offloading; nothing was loaded. Turn swapping off around "
                "load_state_dict (set_swap_module_params_on_conversion(False)): the values are "
                "then copied into the masters"
            )
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, p in _offloaded_in(module):
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor):
            continue  # missing, or not a tensor: load_state_dict reports it
        shape, dtype = without_subclass_dispatch(_shape_dtype_of, p)
        if value.shape != shape or value.dtype != dtype:
            raise TypeError(
                f"offtensor: load_state_dict(assign=True) cannot load {prefix + name!r}, a tensor "
                f"of shape {tuple(value.shape)} and dtype {value.dtype}, into offloaded parameter "
                f"{p._ot.name!r} ({tuple(shape)}, {dtype}): a wrapped model keeps its offloaded "
                "parameters and copies the values into them, so shapes and dtypes must match. "
                f"Nothing in {prefix[:-1] or 'the model'!r} was loaded. Convert the state "
                "dict's tensors, or call offtensor.unwrap(model) first"
            )
    if any(isinstance(p, OffloadedParameter) for p in module._parameters.values()):
        local_metadata["assign_to_params_buffers"] = False


class no_offload(contextlib.ContextDecorator):
    """Turn offloading off temporarily: scopes loaded inside stay resident until the outermost
    `no_offload()` exits, which releases them.

    Useful when the model fits the device for a while (evaluation, generation of many tokens)
    and streaming every forward would only cost time. With `model`, only that wrapped model's
    scopes are held (other wrapped models keep streaming); without, every wrapped model's.

    Example::

        with offtensor.no_offload(model):
            model.generate(input_ids, max_new_tokens=64)  # weights stream once, then stay
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._depth = 0  # the same object may be entered again (a decorated recursive function)
        self._model = weakref.ref(model) if model is not None else None
        if model is not None:
            _engine_of(model, "no_offload")  # wrapped now: refuse early otherwise
        self._holds: weakref.WeakSet | None = None  # where this object is registered while held

    def __enter__(self) -> no_offload:
        self._depth += 1
        if self._depth == 1:
            model = self._model() if self._model is not None else None
            if self._model is not None and model is None:
                raise RuntimeError("offtensor.no_offload: the model it was given no longer exists")
            self._holds = _engine_of(model, "no_offload").holds if model is not None else _engine.holds_for_all
        assert self._holds is not None
        self._holds.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0 or self._holds is None:
            return
        self._holds.discard(self)
        if in_backward():
            return
        # Note [no_offload in several threads]
        # The exit releases what the holds kept, but only of models whose latest forward ran on
        # this thread. Another thread may be inside its own model's forward (one wrapped model
        # per thread): releasing those scopes freed the device copies its ops were reading
        # ("out of bounds for storage of size 0"), even when this no_offload named another
        # model. What such a model kept under a hold of every model is released by its own
        # thread's next pass, which releases what an earlier pass left resident.
        for engine in list(_engine.engines):
            if not engine.hold() and not engine.run_by_another_thread():
                engine.release_all()
