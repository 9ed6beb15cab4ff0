"""Benchmark offtensor against the whole model on the GPU and against other offloading libraries.

Runs a randomly initialised Hugging Face Llama (no download) through six scenarios and, for each
*peer* (a way of placing the model), reports the median wall time, the roofline, peak device
memory and host memory growth. docs/benchmarks.md defines every column.

    python -m benchmarks                          # 8 layers, every scenario and peer
    python -m benchmarks --layers 16 --peers resident offtensor --json out.json
    python -m benchmarks --scenarios step-4x2048 --peers resident offtensor offtensor-overlap
    python -m benchmarks --quick --device cpu     # smoke test: tiny model, no GPU needed
    python -m benchmarks --shape flux             # the Flux.1-dev DiT: inference and a LoRA step
    python -m benchmarks --nproc 2                # data-parallel on 2 GPUs, FSDP2 and DDP as peers
    python -m benchmarks profile-step --help      # the investigations: see --help

Peers other than offtensor are optional: one that is not installed, or that fails, is reported
with a note and the run goes on. Only offtensor's public API is used; transformers, accelerate,
diffusers, peft and psutil are imported when a run needs them, never by `import offtensor`.

Modules, bottom up: measure (timing, memory, bandwidth), scenarios (what runs), model (the
Llama), optimizer (the CPU AdamW measurements), peers (placing the model), results (rows),
workload (one scenario's callables), run (timing a scenario, a peer's pass), rooflines (and
targets), report (printing, JSON), plots (the pictures, with matplotlib), cli; the subcommands
in profiling, host_memory, host_tier, host_overhead (and host_overhead_ops) and plots. The
diffusion transformer (`--shape flux`): dit_blocks (the built-in DiT), dit (the model, its
inputs, the fp8 reference), dit_run (its peers and passes), dit_report (its rooflines and
table); streamed counts what a peer copied.
Several GPUs (`--nproc N`): launch (the ranks, their process groups), multi_peers (placing the
model on each rank), multi_report (rows over the ranks, the table), multi (what each rank runs).
"""

from .cli import main, parse_args

__all__ = ["main", "parse_args"]
