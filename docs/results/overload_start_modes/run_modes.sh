#!/usr/bin/env bash
# Three start modes x two workloads, overload against each (the server started as a user would).
cd /work/main
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OV=".venv/bin/python -m loadtests.load.overload --step-s 5 --max-steps 5 --baseline-s 20 --duration-s 30 --recovery-s 10 --rss-after-s 10"
wait_up() { for i in $(seq 1 120); do curl -s -m 3 localhost:8000/health | grep -q '"status":"ok"' && return 0; sleep 2; done; return 1; }
stop_all() { pkill -TERM -f "serve run" ; sleep 5; .venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f "ray::" ; sleep 3; }
for mode in make serve-run cluster; do
  stop_all
  case $mode in
    make) (setsid make serve > /tmp/ov/server_$mode.log 2>&1 &) ;;
    serve-run) (unset RAY_worker_niceness; setsid .venv/bin/serve run serve_config.yaml > /tmp/ov/server_$mode.log 2>&1 &) ;;
    cluster) RAY_worker_niceness=0 .venv/bin/ray start --head --port 6390 --num-cpus 4 --include-dashboard=false > /tmp/ov/ray_start.log 2>&1
             (setsid .venv/bin/serve run -a 127.0.0.1:6390 serve_config.yaml > /tmp/ov/server_$mode.log 2>&1 &) ;;
  esac
  wait_up || { echo "$mode: server did not come up"; continue; }
  curl -s localhost:8000/health > /tmp/ov/health_$mode.json
  pid=$(pgrep -f "serve run" | head -1)
  for tokens in 96 256; do
    prompt=$([ $tokens = 96 ] && echo 128 || echo 64)
    $OV --url http://127.0.0.1:8000 --server-pid $pid --max-tokens $tokens --prompt-tokens $prompt \
        --json /tmp/ov/ov_${mode}_${tokens}.json > /tmp/ov/ov_${mode}_${tokens}.log 2>&1
    echo "$mode $tokens done $(date +%T)"
  done
done
stop_all
echo ALL DONE
