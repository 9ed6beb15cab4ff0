"""`python -m benchmarks host-tier`: a model larger than its host budget, streamed from its
safetensors file (`Policy(host_budget=...)`), against the drive's own read bandwidth; and the
pinned-ring mode (`Policy(pin_memory="ring")`) against the pinned default.

1. A bf16 checkpoint of `--gib` GiB is written (MLP blocks, random weights drawn on the device,
   large writes), fsynced and dropped from the page cache (posix_fadvise DONTNEED), so what
   follows reads the disk.
2. Drive read: the first `--drive-gib` GiB of the file read with 16 MiB preads on 4 threads (as
   offtensor reads), the cache dropped before and after: the drive's sequential bandwidth.
3. Streamed from files: `offtensor.load` with the budget, then `--passes` forward passes, the
   cache dropped before each: bytes read from the files per pass over the pass's time, against
   the drive's (target >= 80%); the peak host RSS growth from the load on, against the budget +
   the staging ring + 1 GiB.
4. Outputs equal: the streamed model's output against the same blocks applied plainly, each
   block's weights read onto the device in turn.
5. Pinned-ring mode: the first blocks that fit the budget, loaded into RAM pinned (the default)
   and with `pin_memory="ring"`: time per pass and peak host RSS growth of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import struct
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

import offtensor

from .measure import GiB, free_memory, host_rss, peak_rss, reset_peak_rss, timed

MiB = 2**20
READ_THREADS = 4  # as offtensor's readers
READ_CHUNK = 16 * MiB
FILE_NAME = "offtensor-host-tier.safetensors"


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, n: int, h: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def block_bytes(h: int) -> int:
    return 2 * 4 * h * h * 2  # two bf16 matrices


def meta_stack(n: int, h: int) -> Stack:
    with torch.device("meta"):
        return Stack(n, h).to(torch.bfloat16).requires_grad_(False)


def drop_cache(path: Path) -> bool:
    """Drop the file's pages from the page cache (clean pages only: fsync first); False where
    posix_fadvise is missing."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def write_checkpoint(path: Path, n: int, h: int, device: torch.device) -> float:
    """A safetensors file of `n` blocks of random bf16 weights, written with one write per tensor;
    returns the seconds it took (fsync included)."""
    shapes = [(f"blocks.{i}.{name}.weight", shape) for i in range(n)
              for name, shape in (("up", (4 * h, h)), ("down", (h, 4 * h)))]
    header, offset = {}, 0
    for key, shape in shapes:
        nbytes = math.prod(shape) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    generator = torch.Generator(device).manual_seed(0)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key, shape in shapes:
            # Scaled so that 100 residual blocks keep their activations in range.
            std = shape[1] ** -0.5 * (1.0 if ".up." in key else 0.1)
            t = torch.randn(shape, generator=generator, device=device).mul_(std).to(torch.bfloat16).cpu()
            view = t.reshape(-1).view(torch.uint8).numpy().data
            written = 0
            while written < len(view):
                written += f.write(view[written:])
        os.fsync(f.fileno())
    drop_cache(path)
    return time.perf_counter() - start


def drive_bandwidth(path: Path, nbytes: int) -> float:
    """Bytes per second reading the first `nbytes` of the file with READ_CHUNK preads on
    READ_THREADS threads, from the disk (the page cache dropped before and after)."""
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    local = threading.local()

    def read(offset: int) -> int:
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = bytearray(READ_CHUNK)
        return os.preadv(fd, [memoryview(buffer)[: min(READ_CHUNK, nbytes - offset)]], offset)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(READ_THREADS) as pool:
            done = sum(pool.map(read, range(0, nbytes, READ_CHUNK)))
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    drop_cache(path)
    return done / seconds


def forward(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """One forward pass under no_grad: (seconds, its output)."""
    out: list[torch.Tensor] = []

    def run() -> None:
        with torch.no_grad():
            out.append(model(x))

    return timed(device, run), out[0]


def streamed(path: Path, n: int, h: int, budget: int, passes: int, device: torch.device,
             x: torch.Tensor) -> dict[str, Any]:
    """Load with the host budget and time `passes` forward passes from a cold page cache."""
    gc.collect()
    reset_peak_rss()
    before = host_rss() or 0
    model = meta_stack(n, h)
    start = time.perf_counter()
    offtensor.load(model, path, device=device, policy=offtensor.Policy(host_budget=budget))
    load_s = time.perf_counter() - start
    summary = offtensor.summary(model)
    runs = []
    for _ in range(passes):
        drop_cache(path)
        read = offtensor.summary(model).file_bytes_read
        seconds, out = forward(model, x, device)
        runs.append((seconds, offtensor.summary(model).file_bytes_read - read))
    peak = (peak_rss() or 0) - before
    result = {"load_s": load_s, "passes": runs, "rss_growth": peak, "staging": summary.staging_bytes,
              "in_ram": sum(1 for s in summary.scopes if s.masters is not offtensor.MasterHome.FILE),
              "in_files": sum(1 for s in summary.scopes if s.masters is offtensor.MasterHome.FILE),
              "host_bytes": summary.host_bytes, "out": out.float().cpu()}
    del model  # not unwrap: it would read every master in the files into RAM
    free_memory(device)
    return result


def plain_output(path: Path, n: int, h: int, device: torch.device, x: torch.Tensor) -> torch.Tensor:
    """The blocks applied without offtensor, each block's weights read onto the device in turn."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f, torch.no_grad():
        for i in range(n):
            up, down = f.get_tensor(f"blocks.{i}.up.weight"), f.get_tensor(f"blocks.{i}.down.weight")
            x = x + F.linear(torch.relu(F.linear(x, up)), down)
    return x.float().cpu()


def ring_vs_pinned(path: Path, n: int, h: int, passes: int, device: torch.device,
                   x: torch.Tensor) -> dict[str, dict[str, Any]]:
    """The first `n` blocks in RAM, pinned (the default) and staged through the ring: the best
    pass time after one warm-up pass, and the peak host RSS growth from the load on."""
    results = {}
    modes: tuple[tuple[str, Literal["ring"] | None], ...] = (("pinned", None), ("ring", "ring"))
    for mode, pin in modes:
        gc.collect()
        reset_peak_rss()
        before = host_rss() or 0
        model = meta_stack(n, h)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the checkpoint's other blocks are not loaded
            offtensor.load(model, path, device=device, policy=offtensor.Policy(pin_memory=pin))
        runs = [forward(model, x, device) for _ in range(passes + 1)][1:]
        results[mode] = {"pass_s": min(t for t, _ in runs), "rss_growth": (peak_rss() or 0) - before,
                         "masters": offtensor.summary(model).scopes[0].masters.value,
                         "out": runs[-1][1].float().cpu()}
        del model
        free_memory(device)
    return results


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(args: argparse.Namespace, n: int, h: int, device: torch.device, drive: float, s: dict[str, Any],
           plain: torch.Tensor, ring: dict[str, dict[str, Any]], ram_blocks: int) -> dict[str, Any]:
    """Print the results with their verdicts; the JSON record."""
    budget = int(args.host_budget_gib * GiB)
    best = max(read / seconds for seconds, read in s["passes"])
    ratio = best / drive
    passes = ", ".join(f"{t:.2f} s ({_gib(r)} read, {_gib(r / t)}/s)" for t, r in s["passes"])
    print(f"  drive read: {_gib(drive)}/s ({READ_CHUNK // MiB} MiB preads on {READ_THREADS} threads, cold cache)")
    print(f"  streamed from files: load {s['load_s']:.1f} s ({s['in_ram']} scopes in RAM, {s['in_files']} in "
          f"files, staging ring {_gib(s['staging'])}); passes {passes}; read bandwidth {ratio:.0%} of the "
          f"drive's: {_verdict(ratio >= 0.8)} (target >= 80%)")
    # On the CPU the scopes' "device" copies are host memory too: the computing scope, the
    # one before it and the prefetch.
    computing = 3 * block_bytes(h) if device.type == "cpu" else 0
    bound = budget + s["staging"] + GiB + computing
    print(f"  host RSS: peak growth {_gib(s['rss_growth'])} (masters in RAM {_gib(s['host_bytes'])}), bound "
          f"{_gib(bound)} (budget + staging + 1 GiB{' + 3 blocks computing' if computing else ''}): "
          f"{_verdict(s['rss_growth'] <= bound)}")
    equal = torch.equal(s["out"], plain)
    diff = (s["out"] - plain).abs().max().item()
    print(f"  outputs equal: streamed model vs the plain run of {n} blocks: {_verdict(equal)} "
          f"(max abs difference {diff:.3g})")
    pinned, staged = ring["pinned"], ring["ring"]
    same = torch.equal(pinned["out"], staged["out"])
    print(f"  pinned-ring mode ({ram_blocks} blocks, {_gib(ram_blocks * block_bytes(h))} in RAM): default "
          f"({pinned['masters']}) {pinned['pass_s'] * 1e3:.1f} ms per pass, host RSS growth "
          f"{_gib(pinned['rss_growth'])}; ring {staged['pass_s'] * 1e3:.1f} ms per pass "
          f"({staged['pass_s'] / pinned['pass_s']:.2f}x), host RSS growth {_gib(staged['rss_growth'])}; "
          f"outputs equal: {_verdict(same)}")
    return {"blocks": n, "hidden": h, "device": str(device), "drive_bytes_per_s": drive,
            "passes": s["passes"], "read_ratio": ratio, "rss_growth": s["rss_growth"], "rss_bound": bound,
            "outputs_equal": equal,
            "ring": {k: {kk: vv for kk, vv in v.items() if kk != "out"} for k, v in ring.items()},
            "ring_outputs_equal": same}


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=24.0, help="checkpoint size in GiB (default 24)")
    p.add_argument("--host-budget-gib", type=float, default=8.0, help="Policy(host_budget) in GiB (default 8)")
    p.add_argument("--hidden", type=int, default=4096, help="block width: each block is 16 x hidden^2 bytes "
                   "(default 4096: 256 MiB)")
    p.add_argument("--passes", type=int, default=2, help="timed forward passes (default 2)")
    p.add_argument("--drive-gib", type=float, default=8.0, help="GiB read to measure the drive (default 8)")
    p.add_argument("--tokens", type=int, default=16, help="input tokens per pass (default 16)")
    p.add_argument("--dir", default=".", help=f"where to write {FILE_NAME} (a disk, not tmpfs; default .)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (default: deleted at the end)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--quick", action="store_true", help="a 64 MiB checkpoint, 16 MiB budget: seconds on a CPU")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.host_budget_gib, args.hidden, args.drive_gib = 1 / 16, 1 / 64, 256, 1 / 16
    return args


def main(name: str, argv: list[str]) -> int:
    args = parse(name, argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    h = args.hidden
    n = max(1, int(args.gib * GiB // block_bytes(h)))
    ram_blocks = max(1, int(args.host_budget_gib * GiB // block_bytes(h)))
    path = Path(args.dir) / FILE_NAME
    free = shutil.disk_usage(args.dir).free
    if free < n * block_bytes(h) + GiB and not path.exists():
        raise SystemExit(f"bench host-tier: {args.dir} has {_gib(free)} free, the checkpoint needs "
                         f"{_gib(n * block_bytes(h))}; lower --gib or pass another --dir")
    print(f"host tier: {_gib(n * block_bytes(h))} bf16 checkpoint ({n} blocks of {block_bytes(h) / MiB:.1f} MiB, "
          f"hidden {h}), host budget {_gib(args.host_budget_gib * GiB)}, on {device}")
    # The device's kernels and libraries loaded before any host RSS is measured (cuBLAS maps
    # hundreds of MiB of code on its first matmul).
    warm = torch.ones(8, h, device=device, dtype=torch.bfloat16)
    F.linear(torch.relu(warm), warm)
    try:
        seconds = write_checkpoint(path, n, h, device)
        print(f"  wrote the checkpoint in {seconds:.1f} s ({_gib(n * block_bytes(h) / seconds)}/s), page cache dropped")
        drive = drive_bandwidth(path, min(path.stat().st_size, int(args.drive_gib * GiB)))
        x = torch.randn(1, args.tokens, h, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
        s = streamed(path, n, h, int(args.host_budget_gib * GiB), args.passes, device, x)
        plain = plain_output(path, n, h, device, x)
        ring = ring_vs_pinned(path, min(ram_blocks, n), h, args.passes, device, x)
        record = report(args, n, h, device, drive, s, plain, ring, min(ram_blocks, n))
    finally:
        if not args.keep and path.exists():
            path.unlink()
    if args.json is not None:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0
