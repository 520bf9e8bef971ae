"""App arguments are validated once, at build time, with errors that name the field; the
builder turns them into Serve options (max_ongoing_requests well above Serve's 5, torch
threads set deliberately); serve_config.yaml is a valid set of them bound to 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application

from app.args import AppArgs
from app.builder import INGRESS_RUNTIME_ENV, build_app, llm_deployment_options, replica_ingress_options
from app.replica_ingress import ReplicaIngress
from app.errors import OpenAIError, from_exception
from app.proxy_door import CALLBACK_ENV, HA_PROXY_ENV, IMPORT_PATH
from replicas.protocol import InvalidRequestError, QueueFullError, ReplicaUnhealthyError

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_defaults_make_a_valid_replica_config() -> None:
    args = AppArgs()
    replica = args.replica_config()
    engine = replica.engine
    assert args.model == "embedded:smollm2" and args.name == "embedded-smollm2"  # no colon in the served name
    assert engine.policy == "stall_free" and engine.device == "auto"
    assert engine.num_threads == 1  # from num_cpus, not from whatever Ray put in OMP_NUM_THREADS
    assert AppArgs(num_cpus=4).replica_config().engine.num_threads == 4
    assert AppArgs(num_cpus=0.5).replica_config().engine.num_threads == 1
    assert AppArgs(num_cpus=4, engine={"num_threads": 2}).replica_config().engine.num_threads == 2
    gpu = AppArgs(num_gpus=1)
    assert gpu.resolved_num_cpus == 4 and gpu.replica_config().engine.num_threads == 4  # host work
    assert AppArgs(num_gpus=1, num_cpus=2).resolved_num_cpus == 2
    assert replica.stream_interval_s == 0.05  # merged over 50 ms by default
    assert AppArgs(replica={"stream_interval_ms": 0}).replica_config().stream_interval_s == 0
    # The default follows the SLO: a 50 ms SLO needs no second knob.
    assert AppArgs(engine={"tbt_slo_ms": 50}).replica_config().stream_interval_s == 0.025
    assert replica.options.pass_trace_dir is None  # no trace unless asked
    assert AppArgs(replica={"pass_trace_dir": "/tmp/t"}).replica_config().options.pass_trace_dir == "/tmp/t"
    slo = AppArgs(engine={"tbt_slo_ms": 200, "slo_admission": True}).replica_config().engine
    assert slo.tbt_slo_ms == 200 and slo.slo_budget and slo.slo_admission and not args.engine.slo_admission


def test_the_engine_and_replica_records_are_nested_not_copied() -> None:
    """Every engine and replica setting is a field of its record only: AppArgs holds the
    records, and has no field of the same name beside them."""
    import dataclasses

    from replicas.config import EngineConfig, ReplicaOptions

    nested = {f.name for cls in (EngineConfig, ReplicaOptions) for f in dataclasses.fields(cls)}
    assert not nested & set(AppArgs.model_fields)
    assert AppArgs(engine={"policy": "dynamic"}).replica_config().engine == EngineConfig(policy="dynamic", num_threads=1)


@pytest.mark.parametrize("bad,fragment", [
    ({"engine": {"policy": "fastest"}}, "policy"),
    ({"engine": {"max_batch_total_tokens": 8}}, "max_batch_total_tokens must hold at least one KV block"),
    ({"engine": {"max_batch_prefill_tokens": 0}}, "max_batch_prefill_tokens must be a positive integer"),
    ({"replica": {"max_queued_tokens": 0}}, "max_queued_tokens"),
    ({"engine": {"max_num_seqs": "many"}}, "max_num_seqs"),
    ({"scaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas (3) > max_replicas (2)"),
    ({"scaling": {"max_replicas": 2}}, "scaling.by tbt_slo needs engine.tbt_slo_ms"),
    ({"scaling": {"window_s": 0}}, "window_s"),
    ({"scaling_window_s": 30}, "scaling_window_s"),  # the old flat name is refused, not ignored
    ({"engine": {"device": "cuda"}}, "num_gpus is 0"),
    ({"engine": {"max_batch_prefil_tokens": 256}}, "max_batch_prefil_tokens"),  # a typo is not ignored
    ({"max_batch_prefill_tokens": 256}, "max_batch_prefill_tokens"),  # nor a setting at the wrong level
    ({"tool_call_parser": "mistral"}, "tool_call_parser"),  # only hermes is implemented
    ({"replica": {"stream_interval_ms": -1}}, "stream_interval_ms"),
    ({"replica": {"stream_interval_ms": 100}, "engine": {"tbt_slo_ms": 80}},
     "stream_interval_ms (100) must be at most half of tbt_slo_ms (80)"),
    ({"replica": {"stream_interval_ms": 50}, "engine": {"tbt_slo_ms": 99}},
     "stream_interval_ms (50) must be at most half of tbt_slo_ms (99)"),
    ({"proxy_door": {"min_requests": 9, "max_requests": 8}}, "min_requests (9) <= max_requests (8)"),
    ({"proxy_door": {"gap_quantile": 1}}, "gap_quantile"),
    ({"engine": {"kv_cache_memory_fraction": 1.5}}, "kv_cache_memory_fraction"),
    ({"ingress_in_replica": True, "router": "prefix"}, "router prefix needs the prompt"),
    ({"replica": {"engine_process": True}, "engine": {"tensor_parallel_size": 2}},
     "replica.engine_process runs one device's engine"),
])
def test_invalid_args_fail_at_build_time_naming_the_field(bad: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        build_app(bad)
    assert fragment in str(err.value)


def test_builder_options() -> None:
    fixed = llm_deployment_options(AppArgs(num_replicas=2, num_cpus=2, num_gpus=0.5))
    assert llm_deployment_options(AppArgs(num_gpus=1))["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.5}
    assert fixed["max_ongoing_requests"] == 256  # AppArgs' default
    assert fixed["request_router_config"].request_router_class.endswith("TokenLoadRouter")
    assert fixed["graceful_shutdown_timeout_s"] == 820.0  # 4096 tokens at twice 100 ms, rounded up
    counted = llm_deployment_options(AppArgs(scaling={"max_replicas": 4, "by": "ongoing_requests"}))
    assert counted["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in counted
    slo = llm_deployment_options(AppArgs(scaling={"max_replicas": 3}, engine={"tbt_slo_ms": 80}))
    policy = slo["autoscaling_config"].policy
    assert slo["autoscaling_config"].max_replicas == 3 and "num_replicas" not in slo
    assert policy.policy_kwargs["tbt_slo_s"] == 0.08
    assert policy.policy_kwargs["queued_tokens_per_replica"] == 16_384  # half the replica's queue cap
    with pytest.raises(ValidationError, match="tbt_slo_ms"):
        AppArgs(scaling={"max_replicas": 4})  # scaling against the SLO needs the SLO
    p2 = llm_deployment_options(AppArgs(router="power_of_two"))
    assert p2["request_router_config"].request_router_class != fixed["request_router_config"].request_router_class
    prefix = llm_deployment_options(AppArgs(router="prefix", prefix_imbalance=0.25))["request_router_config"]
    assert prefix.request_router_kwargs["ranking"] == "prefix"
    assert prefix.request_router_kwargs["prefix_imbalance"] == 0.25
    assert "prefix_imbalance" not in fixed["request_router_config"].request_router_kwargs
    assert isinstance(build_app({}), Application)
    assert isinstance(build_app(AppArgs()), Application)


def test_engine_replicas_serving_http_take_the_ingress_s_limits() -> None:
    """`ingress_in_replica`: one deployment, the engine replica's resources, router and scaling,
    with the ingress's request cap, proxy queue (429 beyond it) and event loop."""
    args = AppArgs(ingress_in_replica=True, num_replicas=2, num_cpus=2, ingress_max_ongoing_requests=300,
                   ingress_max_queued_requests=40)
    merged, engine = replica_ingress_options(args), llm_deployment_options(args)
    assert merged["name"] == "LLMServer" and merged["num_replicas"] == 2
    assert merged["ray_actor_options"]["num_cpus"] == 2
    assert merged["ray_actor_options"]["runtime_env"] == INGRESS_RUNTIME_ENV
    assert (merged["max_ongoing_requests"], merged["max_queued_requests"]) == (300, 40)
    assert merged["backpressure_config"].status_code == 429
    assert merged["request_router_config"] == engine["request_router_config"]
    app = build_app(args)
    assert app._bound_deployment.func_or_class is ReplicaIngress  # no ingress deployment bound to it
    assert not any(isinstance(a, Application) for a in app._bound_deployment.init_args)


def test_serve_config_yaml_is_valid_and_local() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    [application] = config["applications"]
    assert application["import_path"] == "app.builder:build_app"
    args = AppArgs.model_validate(application["args"])
    assert args.model == "embedded:smollm2" and args.max_ongoing_requests > 5
    # The Serve instance it starts serves through Ray's HAProxy with the door in each engine
    # replica's own server, however Ray was started (docs/architecture.md, "The HTTP path"), and
    # runs each replica's engine loop in a process of its own.
    env = config["controller_options"]["runtime_env"]["env_vars"]
    assert env == {CALLBACK_ENV: IMPORT_PATH, HA_PROXY_ENV: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}
    assert args.ingress_in_replica and args.replica.engine_process
    # Serve's Python proxy, where it runs instead (and as HAProxy's fallback), writes no access
    # log line per request.
    assert config["logging_config"] == {"enable_access_log": False}


def test_replica_refusals_map_to_4xx_through_ray_wrappers() -> None:
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("generate", "Traceback ...", QueueFullError("full", None, 3)).as_instanceof_cause()
    err = from_exception(wrapped)
    assert err.status_code == 429 and err.headers == {"Retry-After": "3"}
    assert err.body() == {"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                    "code": "rate_limit_exceeded"}}
    chained = RuntimeError("outer")
    chained.__cause__ = InvalidRequestError("too long", "max_tokens")
    assert from_exception(chained).status_code == 400
    assert from_exception(chained).param == "max_tokens"
    assert from_exception(OpenAIError(404, "x")).status_code == 404
    down = from_exception(ReplicaUnhealthyError("the engine loop stopped"))  # the status is the app's
    assert (down.status_code, down.error_type, down.code) == (503, "server_error", "engine_unavailable")
    fault = from_exception(KeyError("bug"))
    assert fault.status_code == 500 and fault.error_type == "server_error"


def test_every_queue_in_the_path_is_bounded_and_the_ingress_sized() -> None:
    args = AppArgs()
    assert args.replica_config().engine.queue_timeout_s is None  # the engine's default: no deadline
    served = AppArgs.model_validate(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    served_engine = served.replica_config().engine
    assert served_engine.queue_timeout_s == 10.0 and served_engine.slo_admission  # the served config's
    assert served.replica_config().engine.tbt_slo_ms == 500.0  # and its TBT SLO
    assert llm_deployment_options(args)["max_queued_requests"] == args.max_queued_requests == 256
    assert args.resolved_ingress_replicas == 1
    assert AppArgs(num_replicas=3).resolved_ingress_replicas == 2
    assert AppArgs(scaling={"max_replicas": 4}, engine={"tbt_slo_ms": 50}).resolved_ingress_replicas == 2
    assert AppArgs(num_replicas=3, ingress_replicas=5).resolved_ingress_replicas == 5
    assert args.ingress_num_cpus == 0.5
    ingress = build_app(AppArgs(num_replicas=2)).__dict__  # the bound ingress deployment
    deployment = ingress["_bound_deployment"]
    assert deployment.num_replicas == 2
    config = deployment._deployment_config
    assert config.max_queued_requests == args.ingress_max_queued_requests
    assert config.backpressure_config.status_code == 429
    with pytest.raises(ValidationError, match="queue_timeout_s"):
        AppArgs(engine={"queue_timeout_s": 0})


# Float settings that are not durations (shares, margins, counts of CPUs, a request target).
DIMENSIONLESS = ("fraction", "share", "watermark", "margin", "quantile", "imbalance", "ongoing_requests",
                 "num_cpus", "num_gpus")


def test_every_duration_setting_names_its_unit() -> None:
    """docs/settings.md's unit rule: a float setting is a duration unless it is a known share or
    count, and a duration ends in _ms (a latency a client sees) or _s (everything else)."""
    from app.settings_doc import HEADER, settings

    assert "**Units.**" in HEADER
    floats = [name for name, info in settings() if "float" in str(info.annotation).replace("float16", "")
              .replace("float32", "")]
    durations = [n for n in floats if not any(w in n.split(".")[-1] for w in DIMENSIONLESS)]
    assert durations and all(n.endswith(("_s", "_ms")) for n in durations), durations
    for name in (n for n in durations if n.endswith("_ms")):
        assert any(w in name for w in ("slo", "interval", "target")), f"{name}: ms is for latency targets"
    assert "engine.tbt_slo_ms" in durations and "scaling.window_s" in durations


def test_the_settings_reference_is_generated_and_current() -> None:
    """docs/settings.md is what `python -m app.settings_doc` prints, and each setting is one row
    (one definition): regenerate it after changing a field."""
    from app.settings_doc import render, rows

    doc = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    assert doc.read_text() == render(), "regenerate: python -m app.settings_doc > docs/settings.md"
    names = [name for name, _, _ in rows()]
    assert len(names) == len(set(names))
    for leaf in ("tbt_slo_ms", "queue_timeout_s", "stream_interval_ms", "max_batch_prefill_tokens"):
        assert len([n for n in names if n.split(".")[-1] == leaf]) == 1, leaf


def test_a_tensor_parallel_replica_reserves_a_bundle_per_rank() -> None:
    assert "placement_group_bundles" not in llm_deployment_options(AppArgs())
    gpu = llm_deployment_options(AppArgs(num_gpus=1, engine={"tensor_parallel_size": 2, "device": "cuda"}))
    assert gpu["placement_group_bundles"] == [{"CPU": 4, "GPU": 1}, {"GPU": 1}]
    assert gpu["placement_group_strategy"] == "STRICT_PACK"  # one node: the ranks talk over NVLink/PCIe
    assert gpu["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}  # the replica fits its bundle
    cpu = llm_deployment_options(AppArgs(num_cpus=0.5, engine={"tensor_parallel_size": 3}))
    assert cpu["placement_group_bundles"] == [{"CPU": 0.5}] * 3  # each rank computes as rank 0 does
    with pytest.raises(ValidationError, match="takes whole GPUs, one per rank: num_gpus must be 1"):
        AppArgs(num_gpus=0.5, engine={"tensor_parallel_size": 2, "device": "cuda"})


def test_the_autoscaler_knows_what_a_replica_takes() -> None:
    slo = llm_deployment_options(AppArgs(num_gpus=1, scaling={"max_replicas": 4}, engine={
        "tbt_slo_ms": 80, "tensor_parallel_size": 2, "device": "cuda"}))
    kwargs = slo["autoscaling_config"].policy.policy_kwargs
    assert kwargs["replica_bundles"] == [{"CPU": 4, "GPU": 1}, {"GPU": 1}]
    assert kwargs["within_free_devices"] is True
    one = llm_deployment_options(AppArgs(num_cpus=2, scaling={"max_replicas": 4}, engine={"tbt_slo_ms": 80}))
    assert one["autoscaling_config"].policy.policy_kwargs["replica_bundles"] == [{"CPU": 2, "GPU": 0.0}]
