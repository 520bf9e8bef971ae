"""`python -m replicas` streams text from the embedded model and reports bad input clearly."""

import subprocess
import sys

import pytest

from replicas import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.process


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replicas", *args], capture_output=True, text=True, timeout=120)


def test_cli_streams_the_engines_greedy_text():
    proc = run("--model", "embedded:tiny", "--prompt", "Hello, world", "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert "[12 tokens in" in proc.stderr and "finish_reason=length" in proc.stderr
    engine = Engine.from_pretrained("embedded:tiny", EngineConfig())
    expected = engine.generate(["Hello, world"], SamplingParams(max_tokens=12, temperature=0))[0].text
    assert proc.stdout.rstrip("\n") == expected.rstrip("\n")


def test_cli_rejects_an_empty_prompt():
    proc = run("--model", "embedded:tiny", "--prompt", "", "--max-tokens", "5")
    assert proc.returncode == 2 and "prompt must not be empty" in proc.stderr
