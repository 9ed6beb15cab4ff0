"""Where a scope's device copies go for an eager call of it, worked out once per set of copies:
`ExposurePlan` (Note [an exposure plan])."""

from __future__ import annotations

import operator

from ..dispatch.device_copies import ExposedCopy, Exposure, mark_exposed
from ..scopes.scope import Scope
from .call_checks import Home

# Note [an exposure plan]
# An eager call of a resident scope puts each device copy in the instance dict of each module
# that registers its parameter, and takes it out at the call's end (Note [calls of a loaded
# scope] in engine/hooks.py). Done one parameter at a time in Python, with the checks around
# it, that is a fixed cost per parameter and call, which a DiT block with a few dozen
# parameters pays at every call. What it acts on changes only with new device copies (a release
# under a saved graph retires them: `DeviceBuffer.copies_made`; a load refills the same ones) or
# a parameter registered anew: so a plan holds, for one set of copies, the modules' dicts, the
# names and the copies as parallel tuples, each copy marked once as the plan is made, and the
# calls act on them through `map` (C loops). A module no longer under the scope's (replaced by
# PEFT's merge, say) is left out: no call of the scope reaches it. At each call the
# registrations are checked first (a parameter replaced since: the plan is made again); at its
# end, every copy still in its place is taken out at once, and anything else (a module attribute
# set or deleted in the call) by the one-at-a-time path, which leaves what it did not put there.

_is, _get, _set, _delete = operator.is_, dict.get, operator.setitem, operator.delitem


class ExposurePlan:
    """A scope's device copies and the module attributes they go in, for one set of its copies."""

    __slots__ = ("made", "slots", "leaves", "_registries", "_keys", "_params", "_spaces", "_copies")

    def __init__(self, scope: Scope, homes: list[Home], exposure: Exposure) -> None:
        """`homes`: where the scope's parameters are registered now (ScopeHooks._current_homes)."""
        self.made = scope.device.copies_made
        # The scope's slots but routed expert parameters (whose ops copy the rows they read), and
        # their copies: whose versions tell writes in the call (one per parameter).
        self.slots = [slot for slot in scope.slots if slot.experts is None] if scope.routed else scope.slots
        self.leaves = [slot.device_leaf for slot in self.slots]
        names = {id(m._parameters): m.__dict__ for m in scope.module.modules()}
        homes = [home for home in homes if home[2].experts is None and id(home[0]) in names]
        self._registries = tuple(params for params, _, _ in homes)
        self._keys = tuple(key for _, key, _ in homes)
        self._params = tuple(slot.param for _, _, slot in homes)
        self._spaces = tuple(names[id(params)] for params, _, _ in homes)
        self._copies = tuple(slot.device_leaf for _, _, slot in homes)
        for leaf, slot in zip(self.leaves, self.slots, strict=True):
            # Marked once per copy (Note [copies of an exposed call] in dispatch/device_copies.py)
            if type(leaf) is not ExposedCopy or leaf.__dict__.get("_ot_exposure") is not exposure:
                mark_exposed(leaf, exposure, slot.param)

    def fits(self, scope: Scope) -> bool:
        """Made for the scope's current copies, each parameter still registered where it was."""
        registered = map(_get, self._registries, self._keys)
        return self.made == scope.device.copies_made and all(map(_is, registered, self._params))

    def expose(self) -> None:
        """Each copy into its modules' dicts."""
        any(map(_set, self._spaces, self._keys, self._copies))

    def take_back(self) -> None:
        """Each copy out of the dicts it went in, if it is still there."""
        spaces, keys = self._spaces, self._keys
        if all(map(_is, map(_get, spaces, keys), self._copies)):
            any(map(_delete, spaces, keys))
            return
        for space, key, copy in zip(spaces, keys, self._copies, strict=True):
            if space.get(key) is copy:  # not an attribute set or deleted in the call
                del space[key]

