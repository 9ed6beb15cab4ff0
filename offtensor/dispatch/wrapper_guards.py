"""Guards against data-parallel wrappers that offtensor does not support.

# Note [data-parallel wrappers]
DistributedDataParallel all-reduces gradients from hooks on each parameter's AccumulateGrad
node. offtensor computes an offloaded parameter's gradient on the scope's device copy and writes
it into the host `p.grad` itself (engine/grads.py), so that hook never fires: DDP fails at the second
iteration with "Expected to have finished reduction", or, with `find_unused_parameters=True` or
`static_graph=True`, the ranks' offloaded weights silently drift apart. FSDP2's `fully_shard`
replaces each parameter on its module with a sharded DTensor, so applied after `wrap` it
silently turns offloading off (the scopes keep loading copies nobody reads), and applied before,
`wrap` fails deep in a DTensor op. Each is an error that says what to do; for DDP that is
`offtensor.data_parallel` (Note [data parallel] in distributed/reducer.py):
- `wrap` refuses a model that is (or contains) a DDP, FSDP or FSDP2 module or DTensor parameters;
- DDP's constructor reads every parameter with `p.detach()` to broadcast rank 0's values
  (`_sync_module_states`, unless `init_sync=False`): the handler of `detach` on an offloaded
  parameter raises when DDP's `__init__` is on the stack;
- at the start of each forward pass (and of each call of a scope outside the wrapped model's
  forward: a wrapped ModuleList has no forward of its own, and DDP with delayed all-reduce calls
  `module.forward` without hooks) the engine looks for DDP's `forward` on the stack, and each
  scope call checks that its parameters are still the ones registered on their modules.
All of it runs only while a default process group exists (neither DDP nor FSDP2 can run
without one), so a single-process model pays one `is_initialized()` per scope call.
"""

from __future__ import annotations

import functools
import sys
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

_AVAILABLE = torch.distributed.is_available()
# What torch.distributed.is_initialized() reads (GroupMember.WORLD: the `_World` object's default
# group), where this torch has it; else None and it is asked
_WORLD: Any = getattr(torch.distributed.distributed_c10d, "_world", None) if _AVAILABLE else None
if not hasattr(_WORLD, "_default_pg"):
    _WORLD = None

_DATA_PARALLEL = (
    "offtensor.data_parallel(model) after offtensor.wrap(model) and model.to(device), without "
    "DDP: one model replica per process, each rank on its slice of the batch, gradients averaged "
    "in every backward (offtensor.no_sync(model) for micro-batches that only accumulate)"
)

_DDP_HELP = (
    "offtensor does not support torch.nn.parallel.DistributedDataParallel: DDP all-reduces "
    "gradients from hooks that offloaded parameters never trigger (offtensor writes their host "
    "p.grad itself), so the ranks' weights would drift apart. Use offtensor's own data-parallel "
    "mode instead: " + _DATA_PARALLEL
)

_FSDP_HELP = (
    "offtensor does not support torch.distributed.fsdp.fully_shard (FSDP2) or FSDP yet: both "
    "take over the parameters that offtensor offloads. Either shard without offtensor and let "
    "FSDP2 offload, fully_shard(module, offload_policy=torch.distributed.fsdp.CPUOffloadPolicy()), "
    "or keep offtensor.wrap without sharding (one full replica per process) and use "
    + _DATA_PARALLEL
)


def active() -> bool:
    """True while a default process group exists: the only time DDP or FSDP2 can be at work."""
    if _WORLD is not None:  # asked at each call of a scope: is_initialized()'s three calls, read directly
        return _WORLD._default_pg is not None  # type: ignore[no-any-return]
    return _AVAILABLE and torch.distributed.is_initialized()


def check_model(model: nn.Module) -> None:
    """`wrap`'s check, before it changes anything: no data-parallel wrapper in `model` or its
    submodules, no DTensor parameter.
    A wrapper class can only be in use if its module was imported: nothing is imported here."""
    ddp = nn.parallel.DistributedDataParallel
    fsdp_mod = sys.modules.get("torch.distributed.fsdp")
    fsdp2 = getattr(fsdp_mod, "FSDPModule", None)
    fsdp1 = getattr(fsdp_mod, "FullyShardedDataParallel", None)
    for name, module in model.named_modules():
        where = f"module {name!r}" if name else "the model"
        if isinstance(module, ddp):
            raise TypeError(
                f"offtensor.wrap: {where} is a DistributedDataParallel; {_DDP_HELP}. Pass the "
                "plain model (ddp.module, after building it without DDP) to offtensor.wrap"
            )
        if fsdp2 is not None and isinstance(module, fsdp2):
            raise TypeError(f"offtensor.wrap: {where} is sharded by fully_shard (FSDP2); {_FSDP_HELP}")
        if fsdp1 is not None and isinstance(module, fsdp1):
            raise TypeError(f"offtensor.wrap: {where} is a FullyShardedDataParallel; {_FSDP_HELP}")
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None:
        for name, p in model.named_parameters():
            if isinstance(p, dtensor):
                raise TypeError(
                    f"offtensor.wrap: parameter {name!r} is a DTensor (sharded by fully_shard or "
                    f"tensor parallelism); offtensor offloads plain tensors only. {_FSDP_HELP}"
                )


@functools.cache
def _ddp_codes(*methods: str) -> frozenset[CodeType]:
    ddp = nn.parallel.DistributedDataParallel
    return frozenset(getattr(ddp, m).__code__ for m in methods)


def _find_frame(codes: frozenset[CodeType], limit: int = sys.maxsize) -> FrameType | None:
    """The innermost frame running one of `codes`, among the `limit` frames above the caller's."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and limit > 0:
        if frame.f_code in codes:
            return frame
        frame = frame.f_back
        limit -= 1
    return None


def check_ddp_init(param_name: str) -> None:
    """Called when an offloaded parameter is detached while a process group exists: raise if
    DistributedDataParallel's constructor does it (Note [data-parallel wrappers])."""
    # DDP.__init__ -> _sync_module_states -> p.detach(): a few frames up, never deep.
    if _find_frame(_ddp_codes("__init__"), limit=8) is not None:
        raise RuntimeError(
            f"offtensor: DistributedDataParallel was given a model with offloaded parameters "
            f"(e.g. {param_name!r}); {_DDP_HELP}"
        )


def check_ddp_forward(what: str) -> None:
    """Raise if a DistributedDataParallel's forward is on the stack (it runs `what`)."""
    frame = _find_frame(_ddp_codes("forward", "_run_ddp_forward"))
    if frame is None:
        return
    ddp = frame.f_locals.get("self")
    options = ""
    if isinstance(ddp, nn.parallel.DistributedDataParallel):
        options = (f" (find_unused_parameters={ddp.find_unused_parameters}, "
                   f"static_graph={ddp.static_graph})")
    raise RuntimeError(f"offtensor: {what} is run by a DistributedDataParallel{options}; {_DDP_HELP}")


def replaced_error(param_name: str, scope_name: str, replacement: object) -> RuntimeError:
    kind = type(replacement).__name__ if replacement is not None else "nothing"
    return RuntimeError(
        f"offtensor: offloaded parameter {param_name!r} of scope {scope_name!r} is no longer "
        f"registered on its module (replaced by {kind}), as torch.distributed.fsdp.fully_shard "
        f"does when applied after offtensor.wrap; offloading would silently stop. {_FSDP_HELP}"
    )
