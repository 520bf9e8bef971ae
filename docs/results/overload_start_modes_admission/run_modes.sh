#!/usr/bin/env bash
# Issue 35's table after the queue-admission change (SLO admission, 10 s deadline, refusal on a
# predicted miss): the same runs as ../overload_start_modes_slo/run_modes.sh, serve_config.yaml as
# shipped, one at a time on the 2 cores. The JSON here is from 7aefa0d.
OUT=${OUT:-/tmp/ovadm} exec bash "$(dirname "$0")/../overload_start_modes_slo/run_modes.sh"
