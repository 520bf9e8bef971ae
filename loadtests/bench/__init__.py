"""Benchmarks: the engine's parts and features against baselines, each printing a table and
writing JSON (`python -m loadtests.bench.<name> --help`); start-up time and accuracy too."""
