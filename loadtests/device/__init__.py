"""The check for a lent accelerator: the one-minute probe, then the stages of the full check, and
the wheels its bare image lacks (`python -m loadtests.device.check --help`)."""
