#!/usr/bin/env bash
# Tuning runs for the optimizer overlap and scope splitting (run after gpu_check.sh, which
# installs carried wheels to /tmp/site). Appends to $OUT/sweep.log; prints the result lines.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/sweep.log
run() {
    echo "== $*" >> "$log"
    timeout 120 python3 -m offtensor.bench "$@" >> "$log" 2>&1
}
for cfg in "128 2" "64 1" "128 1" "64 0"; do
    set -- $cfg
    run --scenarios step-4x2048 --peers offtensor-overlap --overlap-piece-mib "$1" --overlap-spare-threads "$2"
done
run --scenarios infer-1x512 train-4x2048 --peers resident offtensor --offtensor-max-scope-mib 256
run --scenarios infer-1x512 --peers resident offtensor --offtensor-prefetch 2
grep -E "^== |overlap timeline|plain CPU fused|^(infer|train|step)[^ ]* +\| offtensor" "$log"
