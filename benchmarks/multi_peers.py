"""The peers of the several-GPU benchmark (`--nproc N`): how each rank places its freshly built
CPU model for data-parallel work. Third-party and distributed code is imported inside the
setups, so a missing one is a note.

A peer is one entry of MULTI_PEERS: its setup, the module it needs, whether its step is
`offtensor.backward_and_step`, and whether offtensor's targets apply to it. A new data-parallel
mode of offtensor (one host copy per node, say) is one more entry with its own setup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .measure import short_error
from .model import BuiltModel, enable_checkpointing
from .peers import PeerOptions, place_outside, setup_offtensor


@dataclass(frozen=True)
class MultiOptions:
    """What the command line passes to the multi-GPU setups."""

    peer: PeerOptions = PeerOptions()
    fsdp2_offload_root: bool = False  # also offload the embeddings, final norm and head


@dataclass(frozen=True)
class MultiPeer:
    """One way of placing the model on each rank."""

    setup: Callable[[BuiltModel, torch.device, MultiOptions], str]  # places built.model; the call in words
    module: str | None  # imported to check the peer can run here
    overlap: bool = False  # the step is offtensor.backward_and_step
    offtensor: bool = False  # offtensor's targets (docs/benchmarks.md, Several GPUs) apply
    grads_sharded: bool = False  # each rank keeps the .grad of the parameters it steps only


def _setup_offtensor_dp(built: BuiltModel, device: torch.device, opts: MultiOptions, shared: bool = False,
                        sharded_loads: bool = False) -> str:
    import offtensor

    how = setup_offtensor(built, device, opts.peer)
    offtensor.data_parallel(built.model, shard_optimizer=shared, shard_loads=sharded_loads)
    options = (", shard_optimizer=True" if shared else "") + (", shard_loads=True" if sharded_loads else "")
    return f"{how}; offtensor.data_parallel(model{options})"


def _shard_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


def _setup_fsdp2(built: BuiltModel, device: torch.device, opts: MultiOptions) -> str:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = _shard_mesh(device)
    # The weights are bf16 already; gradients are reduced in bf16, as offtensor-dp and DDP do.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # Pinned host shards on CUDA; on the CPU there is nothing to pin (and no device to pin for).
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # Checkpointing is switched on before sharding: transformers sets it per decoder layer,
    # and fully_shard swaps each layer's class.
    enable_checkpointing(built.model)
    for layer in built.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    root = offload if opts.fsdp2_offload_root else OffloadPolicy()
    place_outside(built.model, built.layers, device)  # embeddings, final norm, head, rotary buffers
    fully_shard(built.model, mesh=mesh, mp_policy=mp, offload_policy=root)
    where = "offloaded too" if opts.fsdp2_offload_root else "sharded on the device"
    return (f"fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory={device.type == 'cuda'}), "
            f"mp_policy=bf16) on each decoder layer, then on the model (embeddings, norm, head {where})")


def _setup_ddp_resident(built: BuiltModel, device: torch.device, opts: MultiOptions) -> str:
    built.model.to(device)
    enable_checkpointing(built.model)  # on the Hugging Face model, before DDP hides it
    ids = [device.index] if device.type == "cuda" else None
    built.model = nn.parallel.DistributedDataParallel(built.model, device_ids=ids)
    return "the whole model on each device, in DistributedDataParallel"


MULTI_PEERS: dict[str, MultiPeer] = {
    "offtensor-dp": MultiPeer(_setup_offtensor_dp, "offtensor", offtensor=True),
    "offtensor-dp-overlap": MultiPeer(_setup_offtensor_dp, "offtensor", overlap=True, offtensor=True),
    # One host copy per node, each parameter stepped by one rank (Note [one host copy per node]).
    "offtensor-dp-shared": MultiPeer(lambda b, d, o: _setup_offtensor_dp(b, d, o, shared=True), "offtensor",
                                     offtensor=True, grads_sharded=True),
    # Each rank copies 1/N of each layer from the host and the ranks all-gather the rest
    # (Note [sharded loads]); alone, and with the one host copy per node.
    "offtensor-dp-sharded": MultiPeer(lambda b, d, o: _setup_offtensor_dp(b, d, o, sharded_loads=True), "offtensor",
                                      offtensor=True),
    "offtensor-dp-shared-sharded": MultiPeer(
        lambda b, d, o: _setup_offtensor_dp(b, d, o, shared=True, sharded_loads=True), "offtensor",
        offtensor=True, grads_sharded=True),
    "fsdp2-cpu-offload": MultiPeer(_setup_fsdp2, "torch.distributed.fsdp"),
    "ddp-resident": MultiPeer(_setup_ddp_resident, None),
}
MULTI_PEER_NAMES = tuple(MULTI_PEERS)


def multi_peer_unavailable(peer: str, device: torch.device | None = None) -> str | None:
    """Why `peer` cannot run here (on `device`), or None."""
    module = MULTI_PEERS[peer].module
    if module is None:
        return None
    try:
        __import__(module)
        if peer == "fsdp2-cpu-offload":
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401 - torch >= 2.6
    except Exception as exc:  # noqa: BLE001 - not installed, or broken on import
        return f"not available: {short_error(exc)}"
    if (peer == "fsdp2-cpu-offload" and device is not None and device.type == "cpu"
            and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7)):
        # Its forward calls Stream.record_event, which CPU streams lack before 2.7, and the
        # ranks then wait for each other's all-gather until the collective times out.
        return "not available: FSDP2 on the CPU needs torch >= 2.7"
    return None
