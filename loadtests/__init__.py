"""The repository's measuring tools, not part of the product (the wheel ships app, autoscale and
replicas only; run these from the repository root):

- `load/`: load tests against a server: Locust (`make loadtest`), the policy sweep, overload and soak;
- `bench/`: benchmarks, each prints a table and writes JSON (`make bench`: bench.engine);
- `sim/`: the discrete-event cluster simulator, a policy lab on the production scheduler and router;
- `device/`: the check and the one-minute probe for a lent GPU (rehearsed on CPU in `make test`);
- `harness/`: what they share: a server of their own, workloads and arrivals, percentiles,
  /metrics text, the benchmark CLI base.
"""
