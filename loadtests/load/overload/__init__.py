"""Overload and soak measurement: how the server sheds 10x its sustainable load, and recovers.

    python -m loadtests.load.overload --quick                       # smoke run, about 1-2 minutes
    python -m loadtests.load.overload                               # rate search, 10x for 60 s, recovery
    python -m loadtests.load.overload --rate 8 --factor 5           # skip the search
    python -m loadtests.load.overload --start cluster               # on a `ray start --head` instance
    python -m loadtests.load.overload --workload short-output       # 96-token answers to short prompts
    python -m loadtests.load.overload --set replica.max_queued_tokens=4096 --queue-deadline-s 5
    python -m loadtests.load.overload --url http://127.0.0.1:8000 --server-pid 1234   # a running server
    python -m loadtests.load.overload --soak --soak-minutes 30 --soak-fraction 0.7
    python -m loadtests.load.overload --bursts 6 --burst-size 128    # bursts at once on a quiet server

Without `--url` it starts its own server as `--start` says (`loadtests/harness/serve_run.py`): `make`
(what `make serve` runs: `serve run` with `RAY_worker_niceness=0`, on a Ray instance of its own),
`serve-run` (plain `serve run`, workers at Ray's default niceness) or `cluster` (`ray start
--head` on private ports, then `serve run -a`), always from serve_config.yaml with every
`--set key=value` merged in; it ends everything it started at the end, even on error. The JSON
records the mode and what /health said (`proxy_door`, `niceness`). Phases:

1. warm-up: a few requests one at a time, the unloaded TTFT/TBT; the prompt length is calibrated
   so a prompt has about `--prompt-tokens` tokens.
2. sustainable: open-loop Poisson steps (fixed seed) of streaming `/v1/completions` requests of
   the `--workload` (`max_tokens`, `ignore_eos`), the rate doubling from `--start-rate` (halving
   if the first step fails); the highest rate whose completed/offered >= `--keep-up`, with no 429
   and p99 TTFT under `--ttft-bound-s`. `--rate R` measures one step at R instead. Then
   `--baseline-s` at that rate, as long as the overload: its p99 TBT is the overload's baseline
   (a search step's streams mostly run after its arrivals stopped; 0: the step's own).
3. overload (not with `--soak`): `--factor` x that rate for `--duration-s`. Per request: status,
   time to headers, TTFT, every inter-chunk gap, `[DONE]`, in-band error events, cut streams
   (ended without `[DONE]` and without an error event), 429 Retry-After / OpenAI error shape.
4. recovery: one probe (`--probe-max-tokens` long) every `--probe-interval-s` (default: the
   sustainable rate's mean interval, at least 0.5 s: faster probes are an overload of their own)
   right after the overload; seconds until the probes are answered normally (200, TTFT <=
   `--recovery-ttft-factor` x unloaded) from then on.
5. RSS (every second, whole run) of the Ray workers titled `ray::ServeReplica:<app>:LLMServer`,
   `...:OpenAIIngress`, and the HTTP `ray::ProxyActor`: start (just before the overload), peak,
   and `--rss-after-s` after the overload ended.
`--soak`: `--soak-minutes` at `--soak-fraction` x the sustainable rate with a mixed workload
(short/long prompts and outputs, streaming or not, completions or chat); errors, RSS over time
and its least-squares slope in MB/min, and the engine's KV gauges after quiet from the app's
`/metrics` (or `--metrics-url`); targets: no errors, slope <= `--rss-slope-mb-min`, no KV blocks
or requests held after quiet.

Latencies count from each request's scheduled send time (open loop: the arrival generator never
waits for responses, so a server or client that falls behind is measured, not hidden); how late
the generator sent each request is reported too (send lag p50/p99). The load generator stands in
for clients on other machines, so on a machine it shares with the server it keeps its own cost
and wait small (reads parsed in place by a reader callback, no task woken per chunk; once the
server is up, CPU niceness `--client-nice`, -10 when the OS allows it), and it times every gap
twice (`wire`): as its event loop read the chunk, and on arrival, from the kernel's receive time
of the chunk's bytes (`SO_TIMESTAMPNS`), which the generator's own lag does not reach. Chunks
that waited in the socket together carry the later one's arrival, so a gap on arrival can read
long, never short. Its event loop's own lag is reported.
During the overload a second client, the door probe, sends one small request every
`--door-probe-interval-s` from its own process, on a new connection each: the 429 latency is
judged by it too. TBT as read is what the client sees: events read together have a gap of 0;
the accepted TBT target is judged both as read and on arrival (each against the sustainable
rate's measured the same way). Every request is bounded by `--timeout-s` (its own category).
Prints the run table (per phase: 429 p50/p99, accepted TTFT/TBT p99 beside the sustainable
rate's, TBT p99 on arrival, 5xx, cut streams, send lag) and the targets with PASS/MISS (n/a:
nothing to judge, e.g. no 429 at all), and writes everything to `--json`; the server's log lands
next to it.

Modules: `cli` (flags, the run), `phases`, `sse_client` (the load generator), `wire` (its HTTP
client), `workload`, `records`, `summary`, `search`, `report` (targets, tables), `rss`, `gauges`.
"""
