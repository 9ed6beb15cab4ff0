"""One process per device for `--nproc N`: the ranks' environment as torchrun sets it, spawning
the ranks from `python -m benchmarks --nproc N` (torch.multiprocessing), and the process
groups each rank joins.

# Note [two process groups]
Each rank joins the default group (NCCL on CUDA, gloo on the CPU), which the peers under test
use, and a gloo group of its own for the benchmark's bookkeeping: barriers, the agreement after
each setup, gathering the results on rank 0. The bookkeeping group has a long timeout, since
ranks 1.. wait in it while rank 0 measures the one-GPU baseline alone, and a gloo barrier waits
in a socket read, where an NCCL one would keep a CPU core busy beside the baseline's CPU
optimizer. The default group keeps `--collective-timeout-s`: a peer that fails on one rank
leaves the others in a collective, which then fails after that timeout instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BOOKKEEPING_TIMEOUT = datetime.timedelta(hours=1)
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class RankEnv:
    """Where this process is among the ranks (torchrun's variables)."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # ranks on this node
    node: str  # host name: the ranks of one node share its host memory


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def rank_env() -> RankEnv:
    world = int(os.environ["WORLD_SIZE"])
    return RankEnv(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ["LOCAL_RANK"]),
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)), node=socket.gethostname())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(index: int, nproc: int, port: int, fn: Callable[[Any], None], args: Any) -> None:
    """A spawned rank: torchrun's variables for one node, then `fn(args)`."""
    os.environ.update(RANK=str(index), WORLD_SIZE=str(nproc), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(args)


def spawn(nproc: int, fn: Callable[[Any], None], args: Any) -> int:
    """Run `fn(args)` in `nproc` spawned processes, ranks 0..nproc-1 of one node, as
    `torchrun --nproc-per-node nproc` would; 0 when every rank returned, else 1 (the failing
    rank's traceback is printed). Ctrl-C stops them all."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_child, args=(nproc, _free_port(), fn, args), nprocs=nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join(timeout=1.0):
            pass
    except mp.ProcessRaisedException as exc:
        print(f"bench: a rank failed:\n{exc}", flush=True)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"bench: a rank exited: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; stopping the ranks", flush=True)
        return 1
    finally:
        _stop(context.processes)
    return 0


def _stop(processes: list[Any]) -> None:
    """Terminate the ranks still running (ours, by handle), then kill what does not exit."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in processes:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


def init_groups(device: torch.device, collective_timeout_s: float) -> Any:
    """Join the default group (NCCL on CUDA, gloo on the CPU) and return the bookkeeping gloo
    group (Note [two process groups])."""
    dist = torch.distributed
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
    return dist.new_group(backend="gloo", timeout=BOOKKEEPING_TIMEOUT)
