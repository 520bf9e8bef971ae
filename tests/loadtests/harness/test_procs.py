"""A server the harness starts stops on the SIGINT it is sent, even from a process that ignores
SIGINT (a test run started in the background by a shell without job control, or by `nohup`):
there a `serve run` sat out the SIGINT, and its stopper waited out its whole grace (60 s)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from loadtests.harness import procs

pytestmark = pytest.mark.process

SHOW = ("import signal; h = signal.getsignal(signal.SIGINT); "
        "print('ignored' if h is signal.SIG_IGN else getattr(h, '__name__', h))")


def sigint_in_child() -> str:
    return subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=60).stdout.strip()


def test_a_process_started_interruptible_gets_sigints_default_where_this_one_ignores_it() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as this run's own may be
    try:
        assert sigint_in_child() == "ignored"  # inherited: it would sit out a SIGINT
        with procs.interruptible():
            assert sigint_in_child() == "default_int_handler"  # Python's KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # this process as it was
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with procs.interruptible():  # not ignored: left as it is
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
