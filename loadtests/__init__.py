"""Load tests, workloads, benchmarks and the simulator."""
