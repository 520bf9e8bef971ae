#!/usr/bin/env bash
# Issue 35: 10x overload, 96-token outputs (short-output workload), make start, with and without a TBT SLO.
cd /work/main
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OV=".venv/bin/python -m loadtests.load.overload --start make --workload short-output --step-s 5 --max-steps 5 --baseline-s 20 --duration-s 30 --recovery-s 10 --rss-after-s 10"
for name in "$@"; do
  case $name in
    none) sets="" ;;
    slo250) sets="--set engine.tbt_slo_ms=250" ;;
    slo250adm) sets="--set engine.tbt_slo_ms=250 --set engine.slo_admission=true" ;;
    slo150) sets="--set engine.tbt_slo_ms=150" ;;
    slo400) sets="--set engine.tbt_slo_ms=400" ;;
    slo500) sets="--set engine.tbt_slo_ms=500" ;;
    slo1000) sets="--set engine.tbt_slo_ms=1000" ;;
    slo500q5) sets="--set engine.tbt_slo_ms=500 --set engine.queue_timeout_s=5" ;;
  esac
  echo "$(date +%T) $name load $(cut -d' ' -f1 /proc/loadavg)"
  $OV $sets --json /tmp/ov35/ov_$name.json > /tmp/ov35/ov_$name.log 2>&1
  echo "$(date +%T) $name rc=$?"
done
