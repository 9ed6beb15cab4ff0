"""Data-parallel training with offtensor: one process per GPU, each streaming the layers from
its host copy, gradients averaged over the ranks (offtensor.data_parallel).

    torchrun --nproc-per-node 2 examples/train_ddp.py              # 2 GPUs (NCCL), or 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/train_ddp.py --accumulate 4 --overlap
    torchrun --nproc-per-node 2 examples/train_ddp.py --shard-optimizer --overlap

The loop is standard PyTorch: a DistributedSampler gives each rank its slice of the data, the
optimizer is torch.optim.AdamW, gradient checkpointing is on. `--accumulate N` runs N
micro-batches per step, the first N-1 under `offtensor.no_sync(model)`; `--overlap` steps the
CPU optimizer during backward (`offtensor.backward_and_step`). At the end every rank checks that
its weights equal rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from demo import TinyLM  # the demo's stand-in model (embedding, blocks, norm, head), next to this file
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import offtensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overlap", action="store_true", help="use offtensor.backward_and_step")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="one host copy of the masters per node, each parameter stepped by one rank")
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_cuda:
        torch.cuda.set_device(local_rank)  # before wrap: each rank computes on its own GPU
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")

    torch.manual_seed(rank)  # different on each rank: data_parallel copies rank 0's weights
    model = TinyLM(args.layers, args.hidden, args.vocab)
    model.gradient_checkpointing_enable()  # non-reentrant, in training mode
    offtensor.wrap(model, device=device)  # each element of model.layers is offloaded
    model.to(device)  # the embedding, norm and head
    offtensor.data_parallel(model, shard_optimizer=args.shard_optimizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    # A learnable synthetic corpus: short repeating patterns.
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, args.vocab, (64, 8), generator=g)
    data = patterns.repeat(1, args.seq // 8)
    loader = DataLoader(TensorDataset(data), batch_size=args.batch,
                        sampler=DistributedSampler(data, num_replicas=world, rank=rank, seed=0))

    model.train()
    step, micro, began = 0, 0, time.perf_counter()
    while step < args.steps:
        loader.sampler.set_epoch(step)  # type: ignore[attr-defined]
        for (ids,) in loader:
            ids = ids.to(device)
            last = micro == args.accumulate - 1
            # Only the last micro-batch of a step averages the gradients (all of them so far).
            with contextlib.nullcontext() if last else offtensor.no_sync(model):
                loss = model(ids, labels=ids).loss / args.accumulate
                if last and args.overlap:
                    offtensor.backward_and_step(loss, optimizer, zero_grad=True)
                else:
                    loss.backward()
            micro += 1
            if not last:
                continue
            if not args.overlap:
                optimizer.step()
                optimizer.zero_grad()
            micro, step = 0, step + 1
            if rank == 0:
                print(f"step {step}: loss {loss.item() * args.accumulate:.4f}")
            if step == args.steps:
                break
    if args.shard_optimizer:
        offtensor.sync_masters(model)  # every rank's deferred steps are in the shared masters
    else:
        offtensor.wait_for_steps()

    # Every rank took the same steps: the weights are equal everywhere.
    for name, p in model.named_parameters():
        mine = p.detach().to(device)
        rank0 = mine.clone()
        dist.broadcast(rank0, src=0)
        if not torch.equal(mine, rank0):
            raise SystemExit(f"rank {rank}: {name} differs from rank 0's")
    if rank == 0:
        print(f"{world} ranks on {device.type}, {args.steps} steps in "
              f"{time.perf_counter() - began:.1f} s; weights identical on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
