"""What a wrapped model holds right now: is_wrapped, summary (printed by `Summary.__str__` in
api.py)."""

from __future__ import annotations

import torch
from torch import nn

from .api import MasterHome, Residency, ScopeSummary, Summary
from .wrapping import _engine_of, _find_engine


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
                     file_bytes=s.nbytes if s.home is MasterHome.FILE else 0,
                     bytes_to_device=s.traffic.bytes_to_device, expert_hits=s.traffic.expert_hits,
                     expert_misses=s.traffic.expert_misses)
        for s in engine.scopes if id(s.module) in inside
    ]
    allocated = torch.cuda.memory_allocated(engine.device) if engine.streams.is_cuda else None
    ring = engine.ring
    return Summary(str(engine.device), rows, allocated, engine.budget.layout(),
                   staging_bytes=ring.nbytes if ring is not None else 0,
                   file_bytes_read=ring.bytes_read if ring is not None else 0)
