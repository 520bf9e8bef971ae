"""Start-up time of `make serve` as a newcomer meets it: cold (the default model converted from its
GGUF on first use) and warm (loaded from the cache), each timed from the command's start to the
first 200 from `/v1/chat/completions`.

    python -m loadtests.bench.start_time [--runs 1] [--json PATH]

Cold runs point STALLFREE_CACHE at a fresh temporary directory (the user's cache is untouched);
warm runs reuse it. Needs port 8000 free (serve_config.yaml's). `make serve` runs with Ray's files in a
private temp dir (`serve_run.Stack`), so it starts a Ray instance of its own and everything it
started ends with it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx

from loadtests.harness.report import OMIT, bench_parser, write_json
from loadtests.harness.serve_run import Stack

URL = "http://127.0.0.1:8000/v1/chat/completions"
BODY = {"model": "embedded-smollm2", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}


def time_to_first_answer(cache: Path, log: Path, timeout_s: float = 600.0) -> tuple[float, str]:
    """Seconds from `make serve` to the first 200 from the chat endpoint, and that answer."""
    stack = Stack(log)
    start = time.monotonic()
    proc = stack.run(["make", "serve"], stack.env({"STALLFREE_CACHE": str(cache)}))
    try:
        while time.monotonic() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"make serve exited with {proc.returncode}; see {log}")
            try:
                resp = httpx.post(URL, json=BODY, timeout=60)
                if resp.status_code == 200:
                    return time.monotonic() - start, resp.json()["choices"][0]["message"]["content"]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no 200 within {timeout_s:.0f} s; see {log}")
    finally:
        stack.close()


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("loadtests.bench.start_time", __doc__, model=OMIT, seed=OMIT)
    p.add_argument("--runs", type=int, default=1, help="cold + warm pairs")
    p.add_argument("--logs", type=Path, default=Path("loadtests/out/start_time"))
    args = p.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="stallfree-cold-") as cache:
            for kind in ("cold", "warm"):
                seconds, answer = time_to_first_answer(Path(cache), args.logs / f"{kind}-{run}.log")
                rows.append({"run": run, "start": kind, "seconds": round(seconds, 1), "answer": answer})
                print(f"{kind:5} run {run}: first 200 after {seconds:6.1f} s  {answer!r}", flush=True)
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
