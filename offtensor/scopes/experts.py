"""Routed experts: an expert-stacked parameter ([E, ...]) of a mixture-of-experts layer whose
device copy holds only the experts that ops index (ExpertRows), and how wrap finds them.

# Note [routed experts]
A decode token uses k of a layer's E experts (8 of 128 in Qwen3-30B-A3B), so copying the whole
scope moves about E/k times the bytes of experts the token needs. A routed expert parameter is
laid out in its scope's buffers like any other (the device buffer has room for all E experts),
but copy_order puts the routed parameters last, the load plan ends a chunk before them
(scopes/loading.py), and a load in forward copies only the chunks before: the layer's other
parameters prefetch as before. An op on a routed parameter inside its scope takes the general
path of ops (`ParamSlot.ready_copy` refuses it until every expert, or the running call's router
choice, is there), which, once the scope is resident, copies the experts that op reads
(Note [which experts an op reads]) into their rows of the device copy and gives the op the
device copy itself. The copies run on the copy stream, after the load's allocation by the
stream's order; compute waits for their event, device side, and master writes for their reads
(`Streams.reads_masters`). Converting masters (a compute_dtype, Policy(frozen_format)) cross as
their bytes and are converted on the compute stream after that event, row by row, so an expert's
rows are the bytes the whole master's conversion gives (a compressed master has one scale per
expert). While the scope stays resident (kept under a VRAM budget, the last scope kept for
backward) copied experts stay and later ops find them (`Traffic.expert_hits`); the budget counts
the room for all E. A release forgets them.

# Note [which experts an op reads]
- `w[i]`, `w[idx]` (an int, an integer tensor, a list; or a tuple starting with one): those
  experts. transformers' eager experts index `gate_up_proj[expert_idx]` per expert that received
  tokens, its batched_mm implementation `gate_up_proj[expert_ids]`.
- any other op (`w.transpose(-2, -1)`, `grouped_mm(x, w, offs)`): the experts the router chose
  for the experts module's call running now, when its forward takes `top_k_index` or
  `router_indices` (transformers' MoE experts: a forward pre-hook reads it), else every expert.
  grouped_mm reads only the groups its offsets give tokens, which are those experts.
Reading an index tensor's values syncs the host with the device; transformers' eager loop
already does so at each expert (`expert_idx == num_experts`), grouped_mm's hint once per layer.

# Note [one host read per layer]
The router's choice lives on the device, and each read of it from the host waits for the device
to reach the router. The pre-hook reads it once per experts call: `_distinct` copies the index
back when it holds at most E values (a decode step's k per token), else E marks set on the device
(a prefill's tokens), one copy either way (`torch.unique(i).tolist()` would wait twice: unique
sizes its output on the host). An index tensor of an op is read the same way; a 0-d index PyTorch's
indexing reads itself too.

# Note [one copy per run]
Copies are issued per layer, not per expert: the pre-hook that reads the router's choice copies
it for each routed parameter at once, while the scope is resident (else the call's first op does,
by the usual path), before transformers' own preparation (sorting tokens by expert), so that the
link does not idle through it; an eager loop's `w[e]` then finds its rows there. One section
of the copy stream with one event for compute to wait on, one `copy_` per run of consecutive
experts (a lone expert's rows by views made once, `_run_views`; a `_foreach_copy_` from host
memory is slower on CUDA); rows the expert cache holds are copied in one `_foreach_copy_`. Later ops take the
short path of ops (`hinted`), an indexing one checks the rows it reads (Note [ops in a resident
scope] in dispatch/ops.py). Hits and misses count once per expert and call, as an op loop reading
each expert once counted them. Per expert, each copy would cost a stream switch, an event and a
wait, and the eager loop's own read of `expert_idx` would wait for each expert's copy in turn.

# Note [routed experts in backward]
The results are views of the device copy, the parameter's one leaf, so gradients reach the
master by the usual path (Note [gradient path] in engine/grads.py), exactly, trainable experts
included; experts no op read get zero gradients, as in plain autograd. Backward reads the views
it saved without an op on the parameter, so a load in backward (`in_backward`) copies the routed
experts whole, as do a scope's first load when it converts (it has no load plan yet), the staging
ring's, sharded and cast="host" loads, the refresh of a write during the call, and compiled code
(`fill_all`). The saved views read the device copy's storage, which a release frees and the next
load fills anew: a release or load that forgets the rows while a call of the scope since the last
backward could add to a gradient marks them lost (`saved_lost`), and a scope whose backward finds
it loaded by a load in forward (reloaded for a second call of the same forward, carried into the
next call) copies every expert before it runs (`Scope.resident_for_backward`).

# Note [recognising experts]
`Policy(experts="auto")` (default) routes the parameters of a module named `experts` of at least
2 dimensions whose first is the E of a 3-D parameter among them (transformers 5's fused
`gate_up_proj`, `down_proj` and their biases). `Policy(experts=fn)` routes those `fn(name, p)`
marks; `Policy(experts=None)` none. A module named `experts` with no stacked parameter of its
own (a ModuleList of expert modules) streams whole, with one log line saying why.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..api import Residency, ScopeState
from ..dispatch.slot import ParamSlot
from ..storage.compress import PackedMaster
from .expert_cache import ExpertCache
from .loading import Traffic
from .scope import Scope, scope_of
from .streams import Streams

logger = logging.getLogger("offtensor")

# The argument of an experts module's forward that holds the router's choice (transformers 5).
ROUTER_CHOICE = ("top_k_index", "router_indices")


class ExpertRows:
    """Which experts of one routed parameter its device copy holds, and the copies of the others
    (Note [routed experts])."""

    def __init__(self, slot: ParamSlot, streams: Streams, traffic: Traffic, cache: ExpertCache | None = None) -> None:
        self.slot = slot
        self.cache = cache  # the model's, under Policy(expert_cache) (Note [expert cache])
        self.streams = streams
        self.traffic = traffic  # the scope's counters
        self.count = slot.meta.shape[0]  # E
        self.loaded = [False] * self.count  # expert e's rows are on the device (or on their way)
        self.held = 0  # how many are
        self.whole = False
        # Rows a graph saved may still read were forgotten (Note [routed experts in backward])
        self.saved_lost = False
        self.hint: list[int] | None = None  # the router's experts for the running call
        # The hint's experts were filled in this call (Note [one copy per run]): an op that does
        # not index the parameter gets the device copy by the short path (ParamSlot.ready_copy)
        self.hinted = False
        self.row_bytes = slot.master.nbytes // max(self.count, 1)  # one expert's, as the master holds it
        # (device view, master, each expert's rows of both): made once per pair (Note [one copy per run])
        self._rows: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None

    def forget(self, *, graph_reads: bool = False) -> None:
        """No expert is on the device (released, or a load that leaves them to ops). What says
        an expert is there goes first: an interrupt in between leaves less claimed, never more
        (the next load or release forgets again, Note [interrupts] in dispatch/masters.py).
        `graph_reads`: a graph saved by a forward call may still read the rows."""
        self.whole = self.hinted = False
        self.loaded = [False] * self.count
        self.held = 0
        if graph_reads:
            self.saved_lost = True

    def all_there(self) -> None:
        """A load or refresh copied the whole parameter."""
        self.loaded = [True] * self.count
        self.held = self.count
        self.whole = True
        self.saved_lost = False

    def fill_all(self) -> None:
        self.fill(range(self.count))

    def start(self) -> None:
        """At the experts call's start, right after the router's choice (the hint) was read, its
        scope computing and resident (the hook checks that, `_copies_now`): copy it now if an op
        on the parameter would get the device copy as it is (Note [one copy per run])."""
        slot = self.slot
        if (self.whole or self.hint is None or slot.pending_step is not None or slot.stepped_elsewhere is not None
                or slot.scope.writes.written_in_this_call(slot)):
            return  # the first op decides, by the usual path (OpAccess.materialize)
        self.hinted = True
        self.fill(self.hint)

    def before_op(self, func: Any, args: tuple, param: torch.Tensor) -> None:
        """Copy the experts the op `func(*args)` reads onto the device: the router's whole
        choice at the call's first op, so that a loop over experts copies once (Note [one copy
        per run])."""
        if self.whole:
            return
        indexed = None
        if func is torch.Tensor.__getitem__ and len(args) == 2 and args[0] is param:
            indexed = _indexed(args[1], self.count)
        hint = self.hint
        if hint is None:
            self.fill(indexed if indexed is not None else range(self.count))
            return
        if not self.hinted:  # the call's first op, or a release in the call forgot them
            self.hinted = True
            self.fill(hint)
        if indexed is not None:
            loaded = self.loaded
            for e in indexed:
                if not loaded[e]:  # beyond the router's choice
                    self.fill(indexed)
                    break

    def fill(self, experts: Iterable[int]) -> None:
        loaded = self.loaded
        wanted = experts if isinstance(experts, range) else sorted(set(experts))
        new = [e for e in wanted if not loaded[e]]
        todo = new
        cache = self.cache if self.slot.scope.residency is not Residency.KEPT else None
        if cache is not None and todo:  # Note [expert cache]
            found = cache.take(self.slot, todo)
            if found:  # on compute, the current stream: nothing crosses the link
                view = self.slot.device_view
                torch._foreach_copy_([view[e] for e in found], list(found.values()))
                todo = [e for e in todo if e not in found]
        missed, added = len(todo), len(new)
        self.traffic.expert_misses += missed
        self.traffic.expert_hits += len(wanted) - missed
        if missed:
            self._copy(todo)
            if cache is not None:  # after the copy's event, on compute
                cache.offer(self.slot, todo, self.slot.device_view)
        for e in new:
            loaded[e] = True
        self.held += added
        self.whole = self.held == self.count
        if self.whole:
            self.saved_lost = False

    def _copy(self, experts: list[int]) -> None:
        """Copy the experts' rows into the device copy, one copy per run of consecutive experts
        (Note [one copy per run]): on the copy stream, compute waiting for them; a converting
        master's bytes are converted on compute after that."""
        slot, streams = self.slot, self.streams
        view, master, packed = slot.device_view, slot.master, slot.packed
        h2d = streams.h2d()
        # per run of experts: its rows' host tensors on the device (a compressed master's, as its
        # format keeps them: Note [frozen formats] in formats.py, or a master to cast)
        staged: list[tuple[slice, tuple[torch.Tensor, ...]]] = []
        runs = _runs(experts)
        # Until compute waits, as Streams.enqueuing() would, inline: at each copy of experts (Note
        # [copies an interrupt left] in scopes/streams.py).
        left, streams.copies_unwaited = streams.copies_unwaited, True
        with streams.on(h2d):  # plain tensors, nothing requires grad (Note [interrupts])
            if isinstance(packed, PackedMaster):
                for run in runs:
                    rows = tuple(part.to(view.device, non_blocking=True) for part in packed.rows(run))
                    staged.append((run, rows))
                    self.traffic.bytes_to_device += sum(part.nbytes for part in rows)
            elif master.dtype != view.dtype:
                for run in runs:
                    staged.append((run, (master[run].to(view.device, non_blocking=True),)))
                self.traffic.bytes_to_device += len(experts) * self.row_bytes
            else:
                for into, source in self._run_views(runs):
                    into.copy_(source, non_blocking=True)
                self.traffic.bytes_to_device += len(experts) * self.row_bytes
            copied = streams.record(h2d)
        streams.reads_masters(copied)
        compute = streams.compute()
        streams.wait(compute, copied)
        streams.copies_unwaited = left
        for run, rows in staged:  # on compute, the current stream
            if compute is not None:  # allocated on the copy stream, read here
                for part in rows:
                    part.record_stream(compute)
            if isinstance(packed, PackedMaster):
                packed.unpack_rows_into(view[run], rows)
            else:
                view[run].copy_(rows[0])

    def _run_views(self, runs: list[slice]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The device copy's and the master's rows of each run; a run of one expert (a decode
        token's most often) by views made once, not sliced at each copy."""
        slot, made = self.slot, self._rows
        view, master = slot.device_view, slot.master
        if made is None or made[0] is not view or made[1] is not master:
            self._rows = made = (view, master, view.unbind(0), master.unbind(0))
        _, _, view_rows, master_rows = made
        return [(view_rows[r.start], master_rows[r.start]) if r.stop - r.start == 1 else (view[r], master[r])
                for r in runs]


def _runs(experts: list[int]) -> list[slice]:
    """Sorted experts as slices of consecutive ones."""
    ends = [i for i in range(1, len(experts)) if experts[i] != experts[i - 1] + 1]  # where a run breaks
    bounds = [0, *ends, len(experts)]
    return [slice(experts[a], experts[b - 1] + 1) for a, b in zip(bounds, bounds[1:], strict=False)]


def fill_all_experts(scope: Scope) -> None:
    """Every routed expert of a resident scope onto the device: for code that reads device
    copies without ops on the parameters (compiled code, Note [routed experts in backward])."""
    for slot in scope.routed:
        if slot.experts is not None:
            slot.experts.fill_all()


def _indexed(index: Any, count: int) -> list[int] | None:
    """The experts `w[index]` reads along the first dimension; None: not known (all)."""
    if isinstance(index, tuple):
        index = index[0] if index else None
    if isinstance(index, bool):
        return None
    if isinstance(index, int):
        return [index % count]
    if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
        if index.dim() == 0:
            return [int(index) % count]
        return _distinct(index, count, wrap=True)
    if isinstance(index, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in index):
        return [e % count for e in index]
    return None


def _distinct(index: torch.Tensor, count: int, *, wrap: bool) -> list[int]:
    """The experts an integer tensor names, sorted, read with one device-to-host copy (Note [one
    host read per layer]): `wrap`, negative ones count from the end (indexing); else values
    outside [0, count) are left out (a router's sentinel)."""
    flat = index.reshape(-1)
    if flat.numel() <= count:
        values = flat.tolist()
        return sorted({e % count for e in values} if wrap else {e for e in values if 0 <= e < count})
    # Marks on the device, so that a prefill's many tokens read back `count` values, not one each
    if wrap:
        slots, offset = (flat % count).long(), 0
    else:  # [0, count) to 1..count; the rest to 0 or count + 1, dropped
        slots, offset = flat.clamp(-1, count).long() + 1, 1
    seen = torch.zeros(count + 2 * offset, dtype=torch.uint8, device=flat.device).index_fill_(0, slots, 1)
    marks = seen.tolist()
    return [e for e in range(count) if marks[e + offset]]


def route_experts(scope: Scope, cache: ExpertCache | None = None) -> list[RemovableHandle]:
    """Find the scope's routed expert parameters (Note [recognising experts]) and give each its
    ExpertRows, sharing the model's `cache` (Note [expert cache]); the handles of the hooks that
    read the router's choice."""
    choice = scope.policy.experts
    if choice is None:
        return []
    by_name = {slot.name: slot for slot in scope.slots}
    if callable(choice):
        marked = [slot for slot in scope.slots if slot.meta.ndim >= 1 and choice(slot.name, slot.param)]
        _install(scope, marked, cache)
        return []
    handles: list[RemovableHandle] = []
    for name, module in scope.module.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        qual = f"{scope.name}.{name}" if scope.name else name
        own = [by_name[f"{qual}.{n}"] for n, _ in module.named_parameters(recurse=False) if f"{qual}.{n}" in by_name]
        stacked = [slot for slot in own if slot.meta.ndim == 3]
        if not stacked:
            if any(True for _ in module.parameters()):
                logger.info("offtensor: %r holds no expert-stacked (3-D) parameter of its own (separate "
                            "expert modules?): its experts are not routed, scope %r loads them whole",
                            qual, scope.name)
            continue
        count = stacked[0].meta.shape[0]
        routed = [slot for slot in own if slot.meta.ndim >= 2 and slot.meta.shape[0] == count]
        _install(scope, routed, cache)
        names = list(inspect.signature(module.forward).parameters)
        chosen = next((n for n in ROUTER_CHOICE if n in names), None)
        if chosen is not None:
            handles.extend(_hint_hooks(module, routed, chosen, names.index(chosen)))
    return handles


def _copies_now(scope: Scope) -> bool:
    """An experts call may copy its router's choice at its start (ExpertRows.start): the scope
    computes eagerly, resident, with its copy order learned; else its first op decides."""
    return (scope.calls.running > 0 and scope.state is ScopeState.RESIDENT and scope.copy_order is not None
            and not torch.compiler.is_compiling())


def _install(scope: Scope, slots: list[ParamSlot], cache: ExpertCache | None) -> None:
    for slot in slots:
        if slot.experts is None:
            rows = ExpertRows(slot, scope.streams, scope.traffic, cache)
            slot.experts = rows
            scope.routed.append(slot)


def _hint_hooks(module: nn.Module, slots: list[ParamSlot], name: str, position: int) -> list[RemovableHandle]:
    """Hooks that tell the slots which experts the router chose for the module's call: its
    argument `name`, at `position`."""
    rows = [r for slot in slots if isinstance(r := slot.experts, ExpertRows)]
    scope = scope_of(slots[0])  # the module's routed parameters are of one scope

    def chosen(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        index = kwargs.get(name, args[position] if len(args) > position else None)
        experts = None
        if isinstance(index, torch.Tensor) and rows:
            experts = _distinct(index, rows[0].count, wrap=False)
        for r in rows:
            r.hint, r.hinted = experts, False  # set_hint, inline: once per experts call and parameter
        if experts is not None and _copies_now(scope):
            # In the caller's grad mode, as an op's fill: the copies write the device buffer's
            # plain view from detached tensors, which autograd does not record (an interrupt
            # could leave a grad mode set here for good: Note [interrupts] in dispatch/masters.py).
            for r in rows:
                r.start()

    def done(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        for r in rows:
            r.hint, r.hinted = None, False

    return [module.register_forward_pre_hook(chosen, with_kwargs=True),
            module.register_forward_hook(done, with_kwargs=True, always_call=True)]
