"""What the ranks of a data-parallel model must agree on, checked before anything is collective:
`data_parallel`'s arguments, the wrapped model, the process group's backend, and every rank's
description of what it wrapped.

# Note [ranks agree]
`data_parallel` first checks that the ranks agree, with a bounded wait: each rank writes what it
wrapped (scopes with each parameter's name, shape and dtype; the other parameters; its compute
device and host; the flat buffers' layouts) into the process group's store and waits, at most
`timeout`, for the other ranks' entries (`store.wait(keys, timeout)`, not a collective that could
hang). Each rank compares all the entries and so reaches the same verdict: a different selection,
a different device type, or two ranks on one GPU raise the same error on every rank; a rank that
never calls `data_parallel` makes the others raise after `timeout`, naming it.
"""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import torch
from torch import nn

from ..dispatch.param import OffloadedParameter
from ..engine.engine import Engine, engine_of, owning_engine
from ..model.quantized import weights_of
from .matching import wait_for_ranks
from .sharded_loads import shardable
from .shared_masters import new_job_id

_STORE_PREFIX = "offtensor/data_parallel"
_calls: dict[tuple[int, ...], int] = {}  # data_parallel calls per group (ranks), for store keys


def check_arguments(broadcast_weights: bool, shard_optimizer: bool, shard_loads: bool,
                    timeout: datetime.timedelta | float) -> datetime.timedelta:
    """data_parallel's arguments, and that a process group is initialised; the timeout as a timedelta."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "offtensor.data_parallel: no process group is initialised. Launch one process per "
            "device (torchrun --nproc-per-node N script.py) and call "
            "torch.distributed.init_process_group('nccl') (on CUDA; 'gloo' on the CPU) before "
            "offtensor.data_parallel(model)"
        )
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if shard_loads and not (broadcast_weights or shard_optimizer):
        raise ValueError(
            "offtensor.data_parallel: shard_loads=True assembles each scope from slices that "
            "different ranks copy from their own masters, so the masters must be equal on every "
            "rank, but broadcast_weights=False keeps each rank's own values; pass "
            "broadcast_weights=True (or shard_optimizer=True, one shared copy)"
        )
    return timeout


def check_engines(engines: list[Engine]) -> None:
    """Each wrapped model is not in data-parallel mode yet and holds no master that the mode
    does not support."""
    for engine in engines:
        if engine.grads.reducer is not None:
            raise RuntimeError(
                "offtensor.data_parallel: this model is already in data-parallel mode; call it "
                "once per wrapped model (offtensor.unwrap(model) ends the mode)"
            )
        packed = next(((s.name, s.packed) for scope in engine.scopes for s in scope.slots if s.packed is not None),
                      None)
        if packed is not None:  # its broadcast reads and writes uncompressed masters
            raise NotImplementedError(
                f"offtensor.data_parallel: parameter {packed[0]!r} is {packed[1].kept_as()}, "
                "which data-parallel mode does not support yet; wrap without frozen_format (and "
                "load without host_budget)"
            )
        quantized = next((w for scope in engine.scopes for w in weights_of(scope)), None)
        if quantized is not None:  # sharing masters would leave the host weight on the old ones
            raise NotImplementedError(
                f"offtensor.data_parallel: parameter {quantized.name!r} is an already-quantized "
                "weight (Note [quantized weights]), which data-parallel mode does not support yet"
            )


def group_ranks(process_group: Any) -> tuple[Any, list[int]]:
    """The group to average over (default: the world) and its ranks; this rank must be one."""
    dist = torch.distributed
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(group))
    if dist.get_rank() not in ranks:
        raise ValueError(
            f"offtensor.data_parallel: this process (rank {dist.get_rank()}) is not a member of "
            f"the process group given (ranks {ranks}); pass a group this rank belongs to"
        )
    return group, ranks


def agree(model: nn.Module, engines: list[Engine], ranks: list[int], shard_optimizer: bool, shard_loads: bool,
          timeout: datetime.timedelta) -> list[dict[str, Any]]:
    """Every rank's description, once all agree (Note [ranks agree]); else the same error on each."""
    entries = _exchange(ranks, _describe(model, engines, shard_optimizer, shard_loads), timeout)
    _check_agreement(entries)
    return entries


def engines_in(model: nn.Module) -> list[Engine]:
    """The engines of the wrapped models inside `model` (offtensor.wrap may have been called on
    several of its parts)."""
    found: dict[int, Engine] = {}
    for p in model.parameters():
        slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
        if slot is not None:
            engine = owning_engine(slot)
            found.setdefault(id(engine), engine)
    if not found:
        engine_of(model, "data_parallel")  # raises: not wrapped
        raise RuntimeError(
            "offtensor.data_parallel: the model holds no offloaded parameter; call it on the "
            "model you wrapped"
        )
    return list(found.values())


def resident(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters that are not offloaded (each once)."""
    return [p for p in model.parameters() if not isinstance(p, OffloadedParameter)]


def supports(backend: str, device_type: str) -> bool:
    """Whether a group with this backend string ('nccl', 'gloo', 'cpu:gloo,cuda:nccl') can
    reduce tensors of `device_type`. Unknown backends are assumed to."""
    backend = backend.lower()
    if ":" in backend:
        return any(part.split(":")[0].strip() == device_type for part in backend.split(","))
    return not (backend == "nccl" and device_type != "cuda")


def check_backend(model: nn.Module, engines: list[Engine], group: Any) -> None:
    backend = str(torch.distributed.get_backend(group))
    for engine in engines:
        if not supports(backend, engine.device.type):
            raise ValueError(
                f"offtensor.data_parallel: the model computes on {engine.device}, but the process "
                f"group's backend {backend!r} cannot reduce {engine.device.type} tensors; use "
                "init_process_group('gloo') for the CPU, 'nccl' for CUDA"
            )
    names = {id(p): n for n, p in model.named_parameters()}
    for p in resident(model):
        if p.requires_grad and not supports(backend, p.device.type):
            raise ValueError(
                f"offtensor.data_parallel: parameter {names.get(id(p), '?')!r} is not offloaded and "
                f"is on {p.device}, which the process group's backend {backend!r} cannot reduce; "
                "place the model's other parts on the compute device (model.to(device)) first"
            )


def _describe(model: nn.Module, engines: list[Engine], shard_optimizer: bool,
              shard_loads: bool = False) -> dict[str, Any]:
    """What this rank wrapped and where it computes: what the ranks must agree on."""
    scopes = []
    for engine in engines:
        for scope in engine.scopes:
            scopes.append([scope.name, [[s.name, list(s.master.shape), str(s.master.dtype), s.param.requires_grad]
                                        for s in scope.slots]])
    resident = [[n, list(p.shape), str(p.dtype), p.requires_grad]
                for n, p in model.named_parameters() if not isinstance(p, OffloadedParameter)]
    devices = sorted({str(e.device) for e in engines})
    # The flat buffers' layouts: sharded loads exchange byte ranges of them.
    layouts = [[scope.masters.nbytes, scope.device.nbytes, [s.offset for s in scope.slots], shardable(scope)]
               for engine in engines for scope in engine.scopes]
    return {"rank": torch.distributed.get_rank(), "host": socket.gethostname(), "devices": devices,
            "scopes": scopes, "resident": resident, "shard_optimizer": shard_optimizer,
            "shard_loads": shard_loads, "layouts": layouts,
            "job": new_job_id() if shard_optimizer or shard_loads else None}


def _exchange(ranks: list[int], entry: dict[str, Any], timeout: datetime.timedelta) -> list[dict[str, Any]]:
    """Every rank's `entry`, through the default store, waiting at most `timeout` for the others
    (Note [ranks agree]): a rank that never arrives gives an error, not a hang."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    key = tuple(ranks)
    _calls[key] = call = _calls.get(key, 0) + 1
    prefix = f"{_STORE_PREFIX}/{'-'.join(map(str, ranks))}/{call}/"
    store.set(prefix + str(entry["rank"]), json.dumps(entry))
    keys = [prefix + str(r) for r in ranks]
    missing = wait_for_ranks(store, keys, timeout, ranks)
    if missing is not None:
        raise RuntimeError(
            f"offtensor.data_parallel: rank(s) {missing or '?'} did not call "
            f"offtensor.data_parallel within {timeout.total_seconds():g} s (rank "
            f"{entry['rank']} did, for the {_ordinal(call)} time on this group). Every rank must "
            "wrap the model and call offtensor.data_parallel(model); a rank that failed before "
            "shows its own error. Pass timeout= for slow model loading"
        )
    return [json.loads(store.get(k)) for k in keys]


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _check_agreement(entries: list[dict[str, Any]]) -> None:
    """The same verdict on every rank, from every rank's entry."""
    first = entries[0]
    for other in entries[1:]:
        if other["shard_optimizer"] != first["shard_optimizer"]:
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} passed shard_optimizer="
                f"{first['shard_optimizer']} but rank {other['rank']} shard_optimizer="
                f"{other['shard_optimizer']}; pass the same on every rank"
            )
        if first["shard_optimizer"] and other["host"] != first["host"]:
            raise ValueError(
                f"offtensor.data_parallel: shard_optimizer=True shares the masters in one host's "
                f"memory, but rank {first['rank']} runs on {first['host']!r} and rank "
                f"{other['rank']} on {other['host']!r}; several nodes are not supported yet: "
                "call offtensor.data_parallel without shard_optimizer, or pass a process group "
                "of one node's ranks"
            )
        if other["shard_loads"] != first["shard_loads"]:
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} passed shard_loads="
                f"{first['shard_loads']} but rank {other['rank']} shard_loads="
                f"{other['shard_loads']}; pass the same on every rank"
            )
        _compare_scopes(first, other)
        if first["shard_loads"]:
            _compare_layouts(first, other)
        if other["devices"] != first["devices"] and (
            {d.split(":")[0] for d in other["devices"]} != {d.split(":")[0] for d in first["devices"]}
        ):
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} computes on {first['devices']} but "
                f"rank {other['rank']} on {other['devices']}; wrap with the same kind of device on "
                "every rank (device=f'cuda:{local_rank}')"
            )
        _compare_resident(first, other)
    seen: dict[tuple[str, str], int] = {}
    for entry in entries:
        for device in entry["devices"]:
            if not device.startswith("cuda"):
                continue
            where = (entry["host"], device)
            if where in seen:
                raise ValueError(
                    f"offtensor.data_parallel: ranks {seen[where]} and {entry['rank']} both compute "
                    f"on {device} of host {entry['host']!r}; give each rank its own GPU: call "
                    "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before offtensor.wrap, "
                    "or pass device=f'cuda:{local_rank}'"
                )
            seen[where] = entry["rank"]


def _compare_scopes(a: dict[str, Any], b: dict[str, Any]) -> None:
    fix = ("every rank must call offtensor.wrap on the same model with the same predicate and "
           "Policy (the gradients are averaged parameter by parameter)")
    names_a = [s[0] for s in a["scopes"]]
    names_b = [s[0] for s in b["scopes"]]
    if names_a != names_b:
        only_a = [n for n in names_a if n not in names_b]
        only_b = [n for n in names_b if n not in names_a]
        detail = (f"scope {only_a[0]!r} only on rank {a['rank']}" if only_a else
                  f"scope {only_b[0]!r} only on rank {b['rank']}" if only_b else "in another order")
        raise ValueError(
            f"offtensor.data_parallel: rank {a['rank']} wrapped {len(names_a)} scopes and rank "
            f"{b['rank']} {len(names_b)} ({detail}); {fix}"
        )
    for (name, params_a), (_, params_b) in zip(a["scopes"], b["scopes"], strict=True):
        if params_a != params_b:
            diff = next(((x, y) for x, y in zip(params_a, params_b, strict=False) if x != y), None)
            frozen = diff is not None and diff[0][:3] == diff[1][:3]  # only requires_grad differs
            what = (f"parameter {diff[0][0]!r} has requires_grad={diff[0][3]} on rank {a['rank']} and "
                    f"{diff[1][3]} on rank {b['rank']}" if diff is not None and frozen else
                    f"parameter {diff[0][0]!r} is {_shape(diff[0])} on rank {a['rank']} and "
                    f"{diff[1][0]!r} {_shape(diff[1])} on rank {b['rank']}" if diff is not None else
                    f"{len(params_a)} offloaded parameters on rank {a['rank']}, {len(params_b)} on "
                    f"rank {b['rank']}")
            raise ValueError(f"offtensor.data_parallel: scope {name!r} differs between ranks: {what}; {fix}")


def _compare_layouts(a: dict[str, Any], b: dict[str, Any]) -> None:
    """shard_loads: the scopes' flat buffers must be laid out alike (the same Policy)."""
    for (name, _), layout_a, layout_b in zip(a["scopes"], a["layouts"], b["layouts"], strict=True):
        if layout_a != layout_b:
            raise ValueError(
                f"offtensor.data_parallel(shard_loads=True): scope {name!r} is laid out differently "
                f"on rank {a['rank']} ({layout_a[0]} host bytes, {layout_a[1]} device bytes) and rank "
                f"{b['rank']} ({layout_b[0]}, {layout_b[1]}); the ranks exchange byte ranges of it, so "
                "wrap with the same Policy (compute_dtype, cast, frozen_format) on every rank"
            )


def _compare_resident(a: dict[str, Any], b: dict[str, Any]) -> None:
    if a["resident"] == b["resident"]:
        return
    rows_a = {r[0]: r for r in a["resident"]}
    rows_b = {r[0]: r for r in b["resident"]}
    name = next((n for n in [*rows_a, *rows_b] if rows_a.get(n) != rows_b.get(n)), "?")

    def show(rows: dict[str, list], rank: int) -> str:
        row = rows.get(name)
        if row is None:
            return f"absent (or offloaded) on rank {rank}"
        return f"{_shape(row)}, requires_grad={row[3]} on rank {rank}"

    raise ValueError(
        f"offtensor.data_parallel: parameter {name!r}, which is not offloaded, is {show(rows_a, a['rank'])} "
        f"but {show(rows_b, b['rank'])}; every rank must build the same model, offload the same "
        "parameters and freeze the same ones before offtensor.data_parallel"
    )


def _shape(row: list) -> str:
    return f"{tuple(row[1])} {row[2]}"
