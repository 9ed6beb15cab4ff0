"""Planning a wrap before any parameter moves: which modules become scopes (the predicate,
Policy.max_scope_bytes, Policy.param_filter), which parameters each offloads, the sizes of
their host and device layouts, and the checks that refuse a model or a policy up front.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..api import Policy
from ..budget.vram import streaming_bytes
from ..formats import frozen_format
from ..scopes.scope import ALIGN
from ..storage.compress import compresses
from ..storage.file_masters import plan_host_budget
from .quantized import quant_kind, quantized_parts

Predicate = Callable[[str, nn.Module], "bool | Policy"]
# (name, module, policy, its parameters to offload, the selected module it comes from)
Plan = tuple[str, nn.Module, Policy, list[tuple[str, nn.Parameter]], str]
Selected = list[tuple[str, nn.Module, Policy]]


def resolve_device(device: torch.device | str | None) -> torch.device:
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


def select(model: nn.Module, predicate: Predicate | None, policy: Policy) -> Selected:
    selected: Selected = []
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


def _split_large(selected: Selected) -> list[tuple[str, nn.Module, Policy, bool, str]]:
    """Apply Policy.max_scope_bytes: (name, module, policy, recurse, block) per scope to build,
    where recurse=False means the module's direct parameters only (its children are scopes too)
    and `block` names the selected module the scope comes from."""
    out: list[tuple[str, nn.Module, Policy, bool, str]] = []

    def visit(name: str, module: nn.Module, policy: Policy, block: str) -> None:
        limit = policy.max_scope_bytes
        assert limit is None or isinstance(limit, int)  # Policy made it bytes (byte_size)
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


def check_selection(model: nn.Module, selected: Selected, *,
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


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """The offset of each of `sizes` bytes in a scope's flat buffer (each ALIGN-aligned), and its size."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


def compute_dtypes(policy: Policy, params: list[tuple[str, nn.Parameter]]) -> list[torch.dtype]:
    """The dtype each parameter's device copy computes in (Policy.compute_dtype)."""
    compute_dtype = policy.compute_dtype
    return [compute_dtype if compute_dtype is not None and p.is_floating_point() else p.dtype for _, p in params]


def check_budget(plans: list[Plan], policy: Policy) -> None:
    """Policy.vram_budget must leave room for streaming (Note [VRAM budget] in budget/vram.py);
    checked before any parameter moves, with the layout the scopes will have."""
    budget = policy.vram_budget
    if budget is None or budget == "auto":
        return
    assert isinstance(budget, int)  # Policy made it bytes (byte_size)
    blocks: dict[str, int] = {}
    for _, _, scope_policy, params, block in plans:
        dtypes = compute_dtypes(scope_policy, params)
        sizes = [p.numel() * dt.itemsize for (_, p), dt in zip(params, dtypes, strict=True)]
        blocks[block] = blocks.get(block, 0) + layout(sizes)[1]
    total, largest = sum(blocks.values()), max(blocks.values())
    streaming = streaming_bytes(largest, policy.prefetch)
    cache = policy.expert_cache
    if isinstance(cache, int) and budget - cache < min(total, streaming):
        raise ValueError(
            f"offtensor.wrap: Policy(expert_cache={cache}) ({_size(cache)}) leaves {_size(max(0, budget - cache))} "
            f"of Policy(vram_budget={budget}) ({_size(budget)}), below what streaming needs, {_size(streaming)} "
            f"({2 + policy.prefetch} times the largest selected module, {_size(largest)}). The cache is carved "
            f"from the budget: raise vram_budget to at least {_size(cache + min(total, streaming))} or lower "
            "expert_cache")
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


def host_sizes(policy: Policy, params: list[tuple[str, nn.Parameter]]) -> tuple[list[bool], list[int]]:
    """Which masters are stored compressed under Policy(frozen_format) (Note [compressed
    masters]), and each master's host bytes."""
    fmt = frozen_format(policy.frozen_format) if policy.frozen_format else None
    packs = [compresses(fmt, p) for _, p in params]
    return packs, [fmt.nbytes(p.shape, p.dtype) if fmt is not None and pk else p.numel() * p.element_size()
                   for (_, p), pk in zip(params, packs, strict=True)]


def plan_scopes(selected: Selected) -> list[Plan]:
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
def check_memory_not_shared(model: nn.Module, plans: list[Plan]) -> None:
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


def scopes_in_files(plans: list[Plan], policy: Policy) -> set[str]:
    """The scopes whose masters stay in files under Policy(host_budget) (Note [masters in
    files] in storage/file_masters.py)."""
    if policy.host_budget is None:
        return set()
    scopes = [(name, layout(host_sizes(scope_policy, params)[1])[1],
               [qual for qual, p in params if p.requires_grad])
              for name, _, scope_policy, params, _ in plans]
    assert isinstance(policy.host_budget, int)  # Policy made it bytes (byte_size)
    return plan_host_budget(scopes, policy.host_budget)

