#!/usr/bin/env bash
# Tuning runs for the optimizer overlap and scope splitting (run after gpu_check.sh, which
# installs carried wheels to /tmp/site). Appends to $OUT/sweep.log; prints the result lines.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/sweep.log
run() {
    echo "== $*" >> "$log"
    timeout "${SWEEP_TIMEOUT:-300}" python3 -m offtensor.bench "$@" >> "$log" 2>&1
}
# Worker settings (spare threads:piece MiB) timed in turn in one process, beside the plain
# AdamW step: the host's drift between processes would swamp their differences.
run --scenarios step-4x2048 --peers resident offtensor-overlap \
    --overlap-variants 1:64 0:64 2:64 1:16 1:128 --overlap-rounds 5
run --scenarios infer-1x512 train-4x2048 --peers resident offtensor --offtensor-max-scope-mib 256
run --scenarios infer-1x512 --peers resident offtensor --offtensor-prefetch 2
grep -E "^== |overlap timeline|plain CPU fused|measured in turn|spare threads, |^(infer|train|step)[^ ]* +\| offtensor" "$log"
