"""offtensor: train and run PyTorch models larger than the GPU by streaming parameters from
pinned host memory, exactly when they are used.

    import offtensor
    offtensor.wrap(model)       # each element of the outermost nn.ModuleLists becomes a scope
    model.to("cuda")            # the rest of the model; masters stay on the host

See README.md and docs/design.md.
"""

from .api import Layout, MasterHome, Policy, Residency, ScopeState, ScopeSummary, Summary, TensorsSummary, frozen_only
from .dispatch.param import OffloadedParameter
from .distributed.data_parallel import data_parallel, sync_masters
from .distributed.reducer import no_sync
from .distributed.sharded_loads import local_loads
from .model.components import is_wrapped, summary, unwrap, wrap
from .model.controls import no_offload, set_prefetch
from .model.load import load
from .optim.overlap import OverlapReport, backward_and_step, last_stepped, wait_for_steps
from .storage import fp8 as _fp8  # noqa: F401  the built-in frozen formats register themselves on import
from .storage import int8 as _int8  # noqa: F401  (Note [frozen formats] in formats.py)

__all__ = [
    "Layout",
    "MasterHome",
    "OffloadedParameter",
    "OverlapReport",
    "Policy",
    "Residency",
    "ScopeState",
    "ScopeSummary",
    "Summary",
    "TensorsSummary",
    "backward_and_step",
    "data_parallel",
    "frozen_only",
    "is_wrapped",
    "last_stepped",
    "load",
    "local_loads",
    "no_offload",
    "no_sync",
    "set_prefetch",
    "summary",
    "sync_masters",
    "unwrap",
    "wait_for_steps",
    "wrap",
]

__version__ = "0.1.0"
