"""`python -m benchmarks load-speed`: `offtensor.load` of a checkpoint and `offtensor.wrap` of a
model in RAM against the disk's and memory's own speed (issue 42, item 3).

A bf16 checkpoint of `--blocks` MLP blocks (default 16 of hidden 2048: 1.0 GiB) is written once,
then every measurement runs in a fresh process (`--runs` of each, median), since the page cache
and the allocator's state decide these times:

- `safetensors, cold`: the file dropped from the page cache (posix_fadvise DONTNEED), then
  `safetensors.torch.load_file`, `load_state_dict(assign=True)` into the model built on the meta
  device, and one byte of every 4 KiB page read: the file's bytes in memory, at the disk's speed.
- `offtensor.load, cold`: the same drop, then `offtensor.load(model on meta, path, device="cpu")`.
  Target: <= 1.25x safetensors cold.
- `write floor`: allocating the checkpoint's bytes and writing each (numpy, as offtensor's host
  buffers are allocated): what owning the memory costs at the least.
- `offtensor.load, warm`: the file in the page cache. Target: <= 1.25x the write floor.
- `copy floor` and `wrap`: a model in RAM (its parameters in memory of its own, touched), its
  bytes copied into one new allocation, against `offtensor.wrap(model, device="cpu")`. Target:
  wrap <= 1.25x the copy floor.

Each offtensor process checks that the parameters equal the checkpoint's tensors bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .host_tier import Stack, block_bytes, drop_cache, meta_stack, write_checkpoint

MiB = 2**20
FILE_NAME = "offtensor-load-speed.safetensors"
_PAGE = 4096
_TAG = "load-speed-result "
TARGET = 1.25

# kind -> (label, whether the page cache is dropped first)
KINDS = {
    "safetensors-cold": ("safetensors + assign + touch, cold", True),
    "offtensor-cold": ("offtensor.load, cold", True),
    "safetensors-warm": ("safetensors + assign + touch, warm", False),
    "write-floor": ("allocate + write the bytes (floor)", False),
    "offtensor-warm": ("offtensor.load, warm", False),
    "copy-floor": ("model in RAM: copy into a new buffer (floor)", False),
    "wrap": ("model in RAM: offtensor.wrap", False),
}
# ratio name -> (numerator, denominator)
RATIOS = {
    "load cold / safetensors cold": ("offtensor-cold", "safetensors-cold"),
    "load warm / write floor": ("offtensor-warm", "write-floor"),
    "wrap / copy floor": ("wrap", "copy-floor"),
}


# ---- in the child process ------------------------------------------------------------------

def _touch(t: torch.Tensor) -> None:
    """Read one byte of each page of `t` (its bytes in memory, not only mapped)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    int(flat[::_PAGE].sum())


def _equal_to_file(model: torch.nn.Module, path: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        params = dict(model.named_parameters())
        return set(params) == set(f.keys()) and all(
            torch.equal(params[k].detach().view(torch.uint8), f.get_tensor(k).view(torch.uint8)) for k in params)


def _model_in_ram(path: Path, n: int, h: int) -> Stack:
    """The model with parameters in anonymous memory of their own, every page written."""
    from safetensors.torch import load_file

    model = meta_stack(n, h)
    model.load_state_dict({k: v.clone() for k, v in load_file(str(path)).items()}, assign=True)
    return model


def measure(kind: str, path: Path, n: int, h: int) -> dict[str, Any]:
    """One measurement of `kind` in this (fresh) process: seconds, and the check."""
    import offtensor

    nbytes = sum(p.numel() * p.element_size() for p in meta_stack(n, h).parameters())
    check: bool | None = None
    model: torch.nn.Module | None = None
    if kind in ("copy-floor", "wrap"):
        model = _model_in_ram(path, n, h)
    if KINDS[kind][1]:
        drop_cache(path)
    start = time.perf_counter()
    if kind.startswith("safetensors"):
        from safetensors.torch import load_file

        model = meta_stack(n, h)
        model.load_state_dict(load_file(str(path)), assign=True)
        for p in model.parameters():
            _touch(p)
    elif kind.startswith("offtensor"):
        model = offtensor.load(meta_stack(n, h), path, device="cpu")
    elif kind == "write-floor":
        np.empty(nbytes, dtype=np.uint8).fill(1)
    elif kind == "copy-floor":
        assert model is not None
        out, at = np.empty(nbytes, dtype=np.uint8), 0
        for p in model.parameters():
            size = p.numel() * p.element_size()
            np.copyto(out[at : at + size], p.detach().reshape(-1).view(torch.uint8).numpy())
            at += size
    else:
        assert model is not None
        offtensor.wrap(model, device="cpu")
    seconds = time.perf_counter() - start
    if model is not None and (kind.startswith("offtensor") or kind == "wrap"):
        check = _equal_to_file(model, path)
    return {"kind": kind, "seconds": seconds, "check": check}


# ---- in the parent process -----------------------------------------------------------------

def _fresh(kind: str, path: Path, n: int, h: int) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "benchmarks", "load-speed", "--child", kind, "--path", str(path),
                          "--blocks", str(n), "--hidden", str(h)], capture_output=True, text=True, env=env,
                         check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(_TAG)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"bench load-speed: the {kind} process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(_TAG):])


def _warm(path: Path) -> None:
    """The whole file in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * MiB):
            pass


def run(path: Path, n: int, h: int, runs: int) -> dict[str, Any]:
    """Every kind `runs` times, interleaved (the host drifts), each in a fresh process."""
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    checks: dict[str, list[bool]] = {k: [] for k in KINDS}
    for _ in range(runs):
        for kind, (_, cold) in KINDS.items():
            if not cold:
                _warm(path)
            r = _fresh(kind, path, n, h)
            times[kind].append(r["seconds"])
            if r["check"] is not None:
                checks[kind].append(r["check"])
    rows: dict[str, dict[str, Any]] = {
        k: {"label": KINDS[k][0], "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
            "seconds": v, "equal": all(checks[k]) if checks[k] else None} for k, v in times.items()}
    ratios = {name: rows[a]["median_s"] / rows[b]["median_s"] for name, (a, b) in RATIOS.items()}
    return {"rows": rows, "ratios": ratios}


def report(result: dict[str, Any], nbytes: int, runs: int) -> None:
    print(f"\n| measurement ({nbytes / 2**30:.2f} GiB, fresh processes) | median s | min-max s | GiB/s | equal |")
    print("|---|---|---|---|---|")
    for row in result["rows"].values():
        same = "-" if row["equal"] is None else "yes" if row["equal"] else "NO"
        print(f"| {row['label']} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} | "
              f"{nbytes / row['median_s'] / 2**30:.2f} | {same} |")
    print(f"\n| ratio (medians of {runs}) | value | target | |\n|---|---|---|---|")
    for name, value in result["ratios"].items():
        print(f"| {name} | {value:.2f} | <= {TARGET} | {'PASS' if value <= TARGET else 'FAIL'} |")
    equal = all(r["equal"] is not False for r in result["rows"].values())
    print("\nchecks: " + ("every loaded and wrapped parameter equals the checkpoint's tensor" if equal
                         else "A PARAMETER DIFFERS FROM THE CHECKPOINT"))


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=16, help="MLP blocks (default 16)")
    p.add_argument("--hidden", type=int, default=2048,
                   help="block width: each block is 16 x hidden^2 bytes (default 2048: 64 MiB)")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per measurement (default 5)")
    p.add_argument("--dir", default=".", help=f"where to write {FILE_NAME} (a disk, not tmpfs; default .)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (default: deleted at the end); "
                   "an existing one of the same size is reused")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--quick", action="store_true", help="a 64 MiB checkpoint, 2 runs: seconds")
    p.add_argument("--child", choices=list(KINDS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.runs = 512, min(args.runs, 2)
    if args.blocks < 1 or args.hidden < 1 or args.runs < 1:
        p.error("--blocks, --hidden and --runs must be >= 1")
    return args


def main(name: str, argv: list[str]) -> int:
    args = parse(name, argv)
    n, h = args.blocks, args.hidden
    if args.child is not None:
        print(_TAG + json.dumps(measure(args.child, Path(args.path), n, h)), flush=True)
        return 0
    path = Path(args.dir) / FILE_NAME
    nbytes = n * block_bytes(h)
    print(f"load speed: {nbytes / 2**30:.2f} GiB bf16 checkpoint ({n} blocks of {block_bytes(h) / MiB:.1f} MiB), "
          f"{args.runs} fresh processes per measurement, {os.cpu_count()} CPUs")
    try:
        if not (args.keep and path.exists() and path.stat().st_size > nbytes):
            seconds = write_checkpoint(path, n, h, torch.device("cpu"))
            print(f"  wrote the checkpoint in {seconds:.1f} s")
        result = run(path, n, h, args.runs)
    finally:
        if not args.keep and path.exists():
            path.unlink()
    report(result, nbytes, args.runs)
    if args.json is not None:
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "blocks": n, "hidden": h, **result}, indent=1))
    return 0
