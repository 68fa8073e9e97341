#!/bin/bash
# Two commits' e2e benches on one GPU machine, one after the other (a before/after pair on one card).
# Usage, here: mkdir -p .gpu && for c in BEFORE AFTER; do git archive $c -- . ':!models' | gzip > .gpu/$c.tar.gz; done
#        then on the device (carry .gpu and .whl): bash bench/gpu_pair.sh METHOD BATCHES BENCH_TIMEOUT_S BEFORE AFTER
# Each tree runs `BENCH_WHAT=e2e bash bench/gpu_suite.sh` with --methods METHOD --e2e-batches BATCHES;
# its e2e.md and the tail of its bench.log land in $OUT as TREE-METHOD-e2e.md / -bench.log.
set -u
method=$1; batches=$2; timeout_s=$3; shift 3
root=$PWD
for tree in "$@"; do mkdir -p "/tmp/$tree" && tar xzf ".gpu/$tree.tar.gz" -C "/tmp/$tree"; done
for tree in "$@"; do
  start=$(date +%s)
  (cd "/tmp/$tree" && SPECD_WHEEL_DIR="$root/.whl" BENCH_TIMEOUT_S="$timeout_s" BENCH_WHAT=e2e \
     bash bench/gpu_suite.sh "/tmp/res/$tree-$method" --methods "$method" --e2e-batches "$batches") \
     > "/tmp/res-$tree-$method.log" 2>&1
  echo "$tree $method rc=$? $(( $(date +%s) - start )) s"
  pkill -9 -f "[s]pecd[.]cli"; pkill -9 -f "[p]ython3 -m bench"; sleep 2  # a timed-out tree's leftovers
  cp "/tmp/res/$tree-$method/e2e.md" "$OUT/$tree-$method-e2e.md" 2>/dev/null
  tail -c 20000 "/tmp/res/$tree-$method/bench.log" > "$OUT/$tree-$method-bench.log" 2>/dev/null
  tail -n 30 "/tmp/res-$tree-$method.log"
done
