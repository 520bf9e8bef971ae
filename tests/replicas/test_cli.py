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


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt must not be empty"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be in [0, 2], got -1.0"),
    (["--prompt", "hi", "--tensor-parallel-size", "0"], "tensor_parallel_size must be a positive integer, got 0"),
])
def test_cli_refuses_bad_arguments_before_loading_torch(args: list[str], message: str):
    """Refused at once (exit 2, the reason on stderr), before torch and the model load."""
    code = ("import sys; from replicas.__main__ import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "--model", "embedded:tiny", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n", proc.stderr  # one line: the reason
    assert proc.stdout.strip() == "False"


def test_cli_refuses_what_only_the_model_can_tell():
    proc = run("--model", "embedded:tiny", "--prompt", "hi", "--max-tokens", "100000")
    assert proc.returncode == 2 and "maximum context length" in proc.stderr, proc.stderr
