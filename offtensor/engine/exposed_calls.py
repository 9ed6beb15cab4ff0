"""A scope's device copies in its modules' attributes, for one eager call or for a whole
pass of the model: EagerExposure, the part of a scope's hooks that puts them there (Note [calls
of a loaded scope] in engine/hooks.py, Note [exposed passes] in engine/model_hooks.py)."""

from __future__ import annotations

import torch

from ..api import ScopeState
from ..dispatch.device_copies import Exposure
from ..dispatch.ops import resident_copies_ready
from ..scopes.scope import Scope
from ..scopes.write_tracking import versions_of
from .call_checks import Home
from .engine import Engine
from .exposure import ExposurePlan


class EagerExposure:
    """Where a scope's hooks keep the copies an eager call (or an exposed pass) put in its
    modules' attributes, and the plan and versions to take them back with."""

    def __init__(self, scope: Scope, engine: Engine) -> None:
        self.scope = scope
        self.engine = engine
        # The plan of an eager call with the copies exposed and their versions at its start
        # (Note [calls of a loaded scope])
        self._loaded: tuple[ExposurePlan, list[int]] | None = None
        self._plan: ExposurePlan | None = None  # of the current device copies (Note [an exposure plan])
        self._places: list[Home] | None = None  # cache of _current_homes
        # The `.data` aliases of the exposed copies and their versions, while an eager call has
        # them exposed (Note [calls of a loaded scope]); shared with the copies
        self._exposure = Exposure()
        self._attrs: ExposurePlan | None = None  # while they are exposed
        # Exposed for a whole pass of the model, whose calls skip most of the scope's hooks
        self.in_pass = False

    def _expose_plan(self) -> None:
        scope, plan = self.scope, self._plan
        if plan is None or not plan.fits(scope):
            self._plan = plan = ExposurePlan(scope, self._current_homes(), self._exposure)
        self._loaded = (plan, versions_of(plan.leaves))
        # Recorded before the attributes are set: an interrupt between the two leaves what
        # _unexpose_loaded takes back at the next call (Note [interrupts]).
        self._exposure.aliases, self._attrs = [], plan
        plan.expose()
        scope.exposed = True

    def _unexpose_loaded(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Take the device copies back out of the modules' attributes; the `.data` aliases
        noted while they were there."""
        plan, aliases = self._attrs, self._exposure.aliases
        self.scope.exposed = False  # first: writes through the parameters reach the masters again
        if plan is not None:
            plan.take_back()
        # Forgotten once every attribute is back: an interrupt in the loop leaves them recorded.
        self._attrs, self._exposure.aliases = None, None
        return aliases or []

    def _take_back_loaded(self) -> None:
        """The copies taken out of the modules' attributes, what was written into them (or
        through their `.data` aliases) copied into the masters."""
        aliases = self._unexpose_loaded()
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return  # an interrupt came before the copies were exposed
        aliased = {id(leaf) for leaf, alias, v in aliases if alias._version != v} if aliases else set()
        plan, versions = loaded
        # One read per scope (Note [one version read per scope])
        if aliased or versions_of(plan.leaves) != versions:
            self.engine.writes.exposed_call_ended(
                self.scope, list(zip(plan.slots, plan.leaves, versions, strict=True)), aliased=aliased)

    def copies_retired(self) -> None:
        """The scope's copies were retired (Note [higher-order gradients] in
        scopes/device_buffer.py): the plan made for them must not keep them, and their storage,
        alive once no graph holds them; the next call makes one for the copies then current."""
        self._plan = None

    def expose_for_pass(self) -> None:
        self.in_pass = True  # first: an interrupt before the copies go in leaves what leave_pass ends
        if self.scope.state is ScopeState.RESIDENT:
            self._expose_plan()  # else loaded by the pass: exposed at its first call (expose_landed)

    def expose_landed(self) -> ExposurePlan | None:
        """At a call of the scope in an exposed pass that loads it: the compute stream waits for
        the load, and the copies are exposed for the rest of the pass (Note [a pass that reloads
        what a step wrote] in engine/model_hooks.py). Their plan; None if the scope is not such
        a scope (the pass then ends)."""
        scope = self.scope
        if self._attrs is None and self._loaded is None and scope.state is ScopeState.LOADING:
            scope.compute_waits(None)
            if scope.state is ScopeState.RESIDENT and resident_copies_ready(scope, in_call=False):
                self._expose_plan()
        return self._attrs

    def leave_pass(self, *, copy_back: bool) -> None:
        """The exposed pass ends for this scope: its copies taken out, with what the pass wrote
        into them copied into the masters unless an interrupt ended the pass (`copy_back` false:
        Note [writes after an interrupt])."""
        self.in_pass = False
        if copy_back:
            self._take_back_loaded()
        else:
            self._unexpose_loaded()
            self._loaded = None

    def _current_homes(self) -> list[Home]:
        """Where the scope's parameters are registered now (a parameter shared by several
        modules of the scope once per module)."""
        # Not self._homes: the DDP/fully_shard check compares against where they were at wrap.
        places = self._places
        if places is not None:
            for params, key, slot in places:  # a loop, not any(): asked at each call of a kept scope
                if key not in params or params[key] is not slot.param:
                    break
            else:
                return places
        self._places = homes_of(self.scope)
        return self._places


def homes_of(scope: Scope) -> list[Home]:
    """Where the scope's offloaded parameters are registered now: (module._parameters, key,
    slot), a parameter shared by several modules of the scope once per module."""
    ours = {id(slot.param): slot for slot in scope.slots}
    return [(m._parameters, k, ours[id(p)]) for m in scope.module.modules()
            for k, p in m._parameters.items() if p is not None and id(p) in ours]
