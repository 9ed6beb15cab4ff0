"""What a wrapped model holds right now: is_wrapped, summary (printed by `Summary.__str__` in
api.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..api import MasterHome, Residency, ScopeSummary, Summary, TensorsSummary
from ..dispatch.param import OffloadedParameter
from ..engine.engine import engine_of, find_engine
from .quantized import offloaded_weight


def is_wrapped(model: nn.Module) -> bool:
    """True when `model` holds parameters offloaded by `wrap`: it was wrapped, or it holds
    some of a wrapped model's offloaded parameters (a decoder layer of it, or the base model
    PEFT's `merge_and_unload()` returns from a wrapped `PeftModel`)."""
    return find_engine(model) is not None


def summary(model: nn.Module) -> Summary:
    """What `model` holds on the host and on the device right now: per scope, its state, where its
    masters are, its parameters' bytes, the bytes of its masters and of its device copy (and what
    that copy takes while loaded: a kept scope's share of a VRAM budget, also after an optimizer
    step freed it), its loads and those not prefetched in time; then the parameters outside the
    scopes and the buffers, where they are. `print(offtensor.summary(model))` shows a table whose
    total adds up to the model's bytes.

    Example::

        offtensor.wrap(model)
        model.to("cuda")
        loss = model(input_ids=ids, labels=ids).loss
        print(offtensor.summary(model))
    """
    engine = engine_of(model, "summary")
    inside = {id(m) for m in model.modules()}
    rows = [
        ScopeSummary(s.name, s.state, s.num_params(), s.host_bytes(), s.device_bytes(), s.loads,
                     s.loads_on_demand, kept=s.residency is Residency.KEPT,
                     carried=s.residency is Residency.CARRIED, masters=s.source.home,
                     file_bytes=s.masters.nbytes if s.source.home is MasterHome.FILE else 0,
                     param_bytes=sum(slot.param.numel() * slot.param.element_size() for slot in s.slots),
                     loaded_bytes=s.device.nbytes, residency=s.residency,
                     bytes_to_device=s.traffic.bytes_to_device, expert_hits=s.traffic.expert_hits,
                     expert_misses=s.traffic.expert_misses)
        for s in engine.scopes if id(s.module) in inside
    ]
    allocated = torch.cuda.memory_allocated(engine.device) if engine.streams.is_cuda else None
    ring = engine.ring
    rest = [p for p in model.parameters() if not _offloaded(p)]
    cache = engine.expert_cache
    return Summary(str(engine.device), rows, allocated, engine.budget.layout(),
                   expert_cache_bytes=cache.used if cache is not None else None,
                   staging_bytes=ring.nbytes if ring is not None else 0,
                   file_bytes_read=ring.bytes_read if ring is not None else 0,
                   not_offloaded=TensorsSummary.of(rest, engine.device),
                   buffers=TensorsSummary.of(list(model.buffers()), engine.device))


def _offloaded(p: nn.Parameter) -> bool:
    """An offloaded parameter, or a quantized weight whose packed tensors a scope offloads."""
    return getattr(p, "_ot", None) is not None if isinstance(p, OffloadedParameter) else offloaded_weight(p) is not None
