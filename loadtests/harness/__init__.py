"""The one harness the load tests and benchmarks share: a server of their own started as a user
starts it (serve_local, serve_run, procs), fixed-seed workloads, mixes and arrivals, percentiles,
/metrics text, and the benchmark CLI base (report)."""
