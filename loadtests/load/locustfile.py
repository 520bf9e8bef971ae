"""Locust load test: open-loop Poisson arrivals of streamed completions, TTFT/TBT/E2E in the stats.

    python -m locust -f loadtests/load/locustfile.py --headless -u 1 -r 1 --run-time 60s \
        --host http://127.0.0.1:8000 --rps 2 --long-share 0.1 --samples-out samples.jsonl

Open loop: each user is an arrival process that starts every request of `loadtests.harness.mix` in
its own greenlet at its scheduled time (Poisson, `--rps` over all users), never waiting for
earlier ones, so the offered rate holds however slow the server gets. Requests are token-id
prompts with `ignore_eos` and the workload's `max_tokens`, so output lengths are exact; with
`--prompts real --model M` they are chat prompts in M's own template (token ids still).

Per request, custom request events go to Locust's stats (response_time in ms):
`TTFT` (send -> first content chunk), `TBT` (one per gap between content chunks) and `E2E`
(send -> `[DONE]`); the POST itself (time to headers) and every failure (HTTP error, in-band
error event, broken stream, wrong token count) appear under `POST`. A chunk is one engine
iteration's text delta; the server skips deltas with no text (a token that ends inside a UTF-8
character), so a rare gap spans two iterations. With `--samples-out`, every request is also
written as one JSON line (exact timings for the summary; Locust's percentiles are binned).
With `--drain-s D`, arrivals stop D seconds before `--run-time` ends and the run ends as
soon as every request has finished; requests still open at the end are written as unfinished.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from typing import Any, TextIO

import gevent
from gevent.pool import Group
from locust import FastHttpUser, events, task
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC

from loadtests.load.loadtest import add_mix_arguments, add_slo_arguments, mix_from_args
from loadtests.harness.mix import MixSpec, mixed_requests
from loadtests.harness.workloads import ChatPromptPool, WorkloadRequest

PATH = "/v1/completions"
_stream_ids = itertools.count()
_samples: dict[str, TextIO] = {}


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("stallfree load test")
    g.add_argument("--rps", type=float, default=MixSpec().rps,
                   help="offered requests/s over all users (Poisson)")
    add_mix_arguments(g, MixSpec())
    add_slo_arguments(g)
    g.add_argument("--model", default="", help="model name to send (default: the server's)")
    g.add_argument("--drain-s", type=float, default=0.0,
                   help="stop arrivals this long before --run-time ends and wait for open requests")
    g.add_argument("--samples-out", default="", help="write one JSON line per request here")


def mix_spec(options: Any, num_users: int) -> MixSpec:
    """The workload of one user: the offered rate split evenly between users."""
    return mix_from_args(options, options.rps / max(1, num_users))


@functools.cache
def prompt_pool(model: str, seed: int) -> ChatPromptPool:
    """The real prompts of `model` (its tokenizer loaded once per Locust process)."""
    if not model:
        raise ValueError("--prompts real needs --model: its tokenizer templates the prompts")
    return ChatPromptPool.for_model(model, seed)


@events.test_start.add_listener
def _open_samples(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None or not opts.samples_out or "file" in _samples:
        return
    _samples["file"] = f = open(opts.samples_out, "w")  # noqa: SIM115 - closed at test_stop
    meta = {"type": "meta", "host": environment.host, "run_time_s": opts.run_time,
            "num_users": opts.num_users, "ttft_slo_ms": opts.ttft_slo_ms,
            "tbt_slo_ms": opts.tbt_slo_ms, "drain_s": opts.drain_s,
            "mix": mix_spec(opts, 1).to_dict(), "t0_unix": time.time()}
    f.write(json.dumps(meta) + "\n")


@events.test_stop.add_listener
def _close_samples(**_: Any) -> None:
    if (f := _samples.pop("file", None)) is not None:
        f.close()


def record(sample: dict[str, Any]) -> None:
    if (f := _samples.get("file")) is not None:
        f.write(json.dumps(sample) + "\n")
        f.flush()


class StreamingUser(FastHttpUser):
    """One Poisson arrival process; each request streams in a greenlet of its own."""

    concurrency = 4096  # connection pool: an open loop must never queue for a connection
    network_timeout = 900.0  # TTFT can grow long past saturation
    connection_timeout = 30.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.spec = mix_spec(opts, opts.num_users if opts else 1)
        self.pool = prompt_pool(opts.model, self.spec.seed) if self.spec.prompts == "real" else None
        self.stream_id = next(_stream_ids)
        self.requests = Group()

    def on_stop(self) -> None:
        self.requests.kill(block=True, timeout=5)  # open requests record themselves as unfinished

    @task
    def arrivals(self) -> None:
        """Start every request at its arrival time; after the arrival window, drain and quit."""
        opts = self.environment.parsed_options
        window = float("inf")
        if opts and opts.run_time:
            window = max(0.0, opts.run_time - opts.drain_s)
        t0 = time.perf_counter()
        for req in mixed_requests(self.spec, self.stream_id, self.pool):
            if req.arrival_s >= window:
                break
            gevent.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            self.requests.spawn(self.one_request, req, t0)
        self.requests.join()  # --run-time still bounds the wait
        runner = self.environment.runner
        if runner is not None:
            gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)  # let Locust's CSV writer see the last events
            gevent.spawn(runner.quit)  # every request is done: end the run now
        while True:  # until the runner stops this user
            gevent.sleep(60)

    def one_request(self, req: WorkloadRequest, t0: float) -> None:
        opts = self.environment.parsed_options
        body: dict[str, Any] = {"prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                                "stream": True, "stream_options": {"include_usage": True},
                                "ignore_eos": True, "temperature": 0.0}
        if opts and opts.model:
            body["model"] = opts.model
        sample: dict[str, Any] = {"type": "request", "id": req.request_id, "kind": req.kind,
                                  "prompt_len": req.prompt_len, "max_tokens": req.max_tokens,
                                  "scheduled_s": req.arrival_s, "finished": False, "error": None,
                                  "ttft_s": None, "e2e_s": None, "gaps_s": [], "num_chunks": 0,
                                  "completion_tokens": None, "prompt_tokens": None, "status": None}
        start = time.perf_counter()
        sample["start_s"] = start - t0
        try:
            with self.client.post(PATH, json=body, stream=True, catch_response=True,
                                  name=PATH) as resp:
                sample["status"] = resp.status_code
                if resp.status_code != 200:
                    sample["error"] = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
                else:
                    try:
                        sample["error"] = self._read_stream(resp.stream, start, sample)
                    except Exception as exc:  # noqa: BLE001 - a broken stream is a failure
                        sample["error"] = f"{type(exc).__name__}: {exc}"
                if sample["error"]:
                    resp.failure(sample["error"])
                else:
                    resp.success()
        finally:  # also when the run ends first (GreenletExit): then it is written as unfinished
            sample["end_s"] = time.perf_counter() - t0
            record(sample)

    def _read_stream(self, stream: Any, start: float, sample: dict[str, Any]) -> str | None:
        """Read SSE lines as they arrive; fire TTFT/TBT/E2E. Returns an error message or None."""
        last: float | None = None
        while True:
            line = stream.readline(b"\n")
            now = time.perf_counter()
            if not line:
                return "stream ended before [DONE]"
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return f"in-band error: {chunk['error'].get('message', chunk['error'])}"
            if chunk.get("usage"):
                sample["completion_tokens"] = chunk["usage"]["completion_tokens"]
                sample["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
            if not chunk.get("choices"):
                continue
            sample["num_chunks"] += 1
            if last is None:
                sample["ttft_s"] = now - start
                self._fire("TTFT", sample["ttft_s"] * 1e3)
            else:
                sample["gaps_s"].append(now - last)
                self._fire("TBT", (now - last) * 1e3)
            last = now
        sample["e2e_s"] = time.perf_counter() - start
        tokens = sample["completion_tokens"]
        if tokens != sample["max_tokens"]:
            return f"expected {sample['max_tokens']} tokens (ignore_eos), usage says {tokens}"
        sample["finished"] = True
        self._fire("E2E", sample["e2e_s"] * 1e3, tokens)
        return None

    def _fire(self, kind: str, ms: float, length: int = 0, error: str | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=PATH, response_time=ms, response_length=length,
            exception=RuntimeError(error) if error else None, context={})
