#!/usr/bin/env bash
# Issue 49's 10x overload, before (0bf6edd: Serve's Python proxy with the door) and after
# (HAProxy mode, the door in the ingress): the overload tool started from a git worktree of each
# commit, so each starts its own code's server as a user would (plain `serve run`), the tiny
# model, one run at a time on the 2 cores (the lock other benchmarks on this box take too).
# Usage: run.sh BEFORE_REF AFTER_REF [OUT]
set -e
BEFORE=${1:-0bf6edd} AFTER=${2:-HEAD} OUT=${3:-/tmp/ov_http_path}
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OV="-m loadtests.load.overload --start serve-run --model embedded:tiny --step-s 10 --max-steps 5 --baseline-s 20 --duration-s 30 --recovery-s 10 --rss-after-s 10"
mkdir -p "$OUT"
for which in after before; do
  ref=$AFTER; [ $which = before ] && ref=$BEFORE
  tree=$(mktemp -d /tmp/ov-$which-XXXX)
  git -C "$REPO" worktree add --detach "$tree" "$ref" -q
  # the tool and its harness from this checkout; the server's code from the worktree
  cp -r "$REPO/loadtests" "$tree/"
  (cd "$tree" && PYTHONPATH="$tree" flock /tmp/bench.lock "$REPO/.venv/bin/python" $OV --json "$OUT/ov_$which.json" > "$OUT/ov_$which.log" 2>&1)
  git -C "$REPO" worktree remove --force "$tree"
done
