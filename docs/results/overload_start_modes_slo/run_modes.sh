#!/usr/bin/env bash
# Issue 35's table: every start mode x both workloads, serve_config.yaml as shipped, the overload
# tool starting the server itself as a user would (--start), one run at a time on the 2 cores.
cd /work/main
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/ovfinal}
OV=".venv/bin/python -m loadtests.load.overload --step-s 10 --max-steps 4 --baseline-s 20 --duration-s 30 --recovery-s 10 --rss-after-s 10"
for mode in make serve-run cluster; do
  for w in 96 256; do
    if [ $w = 96 ]; then wl="--workload short-output"; else wl="--workload uniform --max-tokens 256 --prompt-tokens 64"; fi
    echo "$(date +%T) $mode $w load $(cut -d' ' -f1 /proc/loadavg)"
    $OV --start $mode $wl --json $OUT/ov_${mode}_${w}.json > $OUT/ov_${mode}_${w}.log 2>&1
    echo "$(date +%T) $mode $w rc=$?"
  done
done
echo ALL DONE
