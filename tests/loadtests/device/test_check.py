"""The GPU check is rehearsed on CPU as the bare image would run it (only the image's packages and
the wheels it gets), and every stage it records holds sane numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests.device import check as gpu_check, wheels as gpu_wheels
from loadtests.device.runner import RunnerOptions

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def image() -> tuple[list[str], set[str]]:
    return gpu_wheels.image_site()


@pytest.fixture(scope="module")
def rehearsal(image, tmp_path_factory) -> dict:
    """`python -m loadtests.device.check --device cpu --small`, with no site-packages but the image's."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    site = tmp / "site"
    site.mkdir()
    out = tmp / "check.json"
    done = subprocess.run([sys.executable, "-S", "-m", "loadtests.device.check", "--device", "cpu", "--small",
                           "--out", str(out)], cwd=gpu_wheels.REPO, env=gpu_wheels.image_env(image[1], site),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_probe_rehearsal_starts_compiles_only_at_start_and_agrees_with_hf(image, tmp_path) -> None:
    """`python -m loadtests.device.check --device cpu --small --probe` as the bare image runs it: the
    flex path with decode graphs starts (no fallback), nothing compiles after warm-up over a
    schedule that preempts, no graph breaks, HF's greedy tokens for every prompt; one engine."""
    site = tmp_path / "site"
    site.mkdir()
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "-S", "-m", "loadtests.device.check", "--device", "cpu", "--small",
                           "--probe", "--out", str(out)], cwd=gpu_wheels.REPO,
                          env=gpu_wheels.image_env(image[1], site), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(out.read_text())["probe"]
    assert probe["compiles_after_warmup"] == 0 and probe["graph_breaks"] == 0 and probe["fallback"] is False
    assert probe["parity_passed"] and probe["finished"] and list(probe["stages"]) == ["device", "layout 4:1"]
    device, layout = probe["stages"]["device"], probe["stages"]["layout 4:1"]
    assert device["status"] == "complete" and device["peak_bandwidth"]["source"] == "nominal (cpu)"
    assert device["transformers"] and device["transformers_from"]
    assert layout["status"] == "complete" and layout["path"] == "flex+graphs" and layout["preemptions"] > 0
    assert layout["parity_equal"] == layout["parity_prompts"] == 8 and layout["compiles_at_warmup"] >= 4 + 4
    assert layout["kernel_choices"]["available"] and layout["kernel_choices"]["choices"] == []  # none lowered on CPU


def test_a_probe_killed_after_its_first_stage_leaves_that_stage(tmp_path) -> None:
    """The probe rewrites its JSON (atomically) after every stage: kill -9 while the second stage
    runs, and the file holds the first, whole."""
    out = tmp_path / "probe.json"
    proc = subprocess.Popen([sys.executable, "-m", "loadtests.device.check", "--device", "cpu", "--small", "--probe",
                             "--out", str(out)], cwd=gpu_wheels.REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        running = proc.poll() is None  # the layout stage (seconds of compiling) is still to come
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert running, "the probe ended before it could be killed"
    probe = json.loads(out.read_text())["probe"]
    assert probe["finished"] is False and list(probe["stages"]) == ["device"]
    assert probe["stages"]["device"]["status"] == "complete" and probe["stages"]["device"]["torch"]
    assert not list(tmp_path.glob("*.tmp")) or json.loads(out.read_text())  # the file itself is whole


def test_the_wheels_are_what_the_image_lacks(image) -> None:
    needed, allowed = image
    assert {"pydantic", "pydantic-core"} <= set(needed)  # replicas/config.py's records
    assert "typing-extensions" in needed  # pydantic 2.14 needs 4.16's Sentinel; the image's may be older
    # llguidance is imported on the first constrained request (replicas/execution/guided.py), so it does not travel
    assert "llguidance" not in gpu_wheels.repo_imports("replicas.execution.guided") and "llguidance" not in needed
    assert not {"ray", "torch", "numpy", "triton"} & set(needed)  # the image's CUDA builds run
    # the transformers the graphs were traced with here travels, with what it requires
    assert {"transformers", "tokenizers", "huggingface-hub", "safetensors"} <= set(needed)
    assert "ray" not in allowed and "torch" in allowed
    command = gpu_wheels.download_command(needed, "DIR")
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    assert all(any(arg.startswith(f"{d}==") for arg in command) for d in needed)


def test_every_stage_finishes_within_its_budget_without_errors(rehearsal) -> None:
    assert list(rehearsal["stages"]) == ["parity", "mbu", "prefill", "tbt"]
    for record in rehearsal["stages"].values():
        assert record["status"] == "complete" and not record["errors"] and not record["skipped"]
    assert rehearsal["meta"]["runner"]["runner_reports"]["attention_backend"] == "sdpa" and "tbt" in rehearsal["table"]


def test_parity_passes(rehearsal) -> None:
    items = rehearsal["stages"]["parity"]["items"]
    greedy, bf16 = items["greedy_fp32"], items["teacher_forced_bf16"]
    assert greedy["passed"] and greedy["equal_prompts"] == len(gpu_check.SMALL_PLAN.parity_lengths)
    # bf16 is not exact, and the engine's error is of HF's own size
    assert 0 < bf16["engine_mean_abs"] <= 2 * bf16["hf_bf16_mean_abs"] and bf16["passed"]
    new = gpu_check.SMALL_PLAN.parity_new_tokens // 2
    assert bf16["positions"] == sum(n - 1 + new for n in gpu_check.SMALL_PLAN.parity_lengths)


def test_decode_mbu_is_a_fraction_of_the_bytes_every_step_must_read(rehearsal) -> None:
    plan, items = gpu_check.SMALL_PLAN, rehearsal["stages"]["mbu"]["items"]
    expected = [f"{s} B={b}" for s in ("engine", "hf_eager") for b in plan.mbu_batches]
    assert list(items) == expected + [f"hf_compiled B={b}" for b in plan.compiled_batches]
    shape = gpu_check.SMALL
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 4
    weights = {r["bytes_per_step"] - r["context_tokens"] * kv_per_token for r in items.values()}
    assert len({round(w) for w in weights}) == 1  # the same model: the KV is all that differs
    for r in items.values():
        assert 0 < r["mbu"] < 1 and r["steps"] == plan.mbu_steps
        b = r["batch"]
        assert b * plan.mbu_context < r["context_tokens"] < b * (plan.mbu_context + 2 * plan.mbu_steps + 8)
        assert math.isclose(r["mbu"], r["bytes_per_step"] / (r["step_ms"] / 1e3) / 0.1e12)


def test_prefill_runs_each_budget_in_full_passes(rehearsal) -> None:
    plan, items = gpu_check.SMALL_PLAN, rehearsal["stages"]["prefill"]["items"]
    assert [r["max_batch_prefill_tokens"] for r in items.values()] == list(plan.prefill_budgets)
    for r in items.values():
        assert r["prompt_tokens"] == plan.prefill_tokens and r["tokens_per_s"] > 0
        assert r["passes"] == plan.prefill_tokens // r["max_batch_prefill_tokens"]


def test_the_long_prompt_stalls_every_stream_under_dynamic_only(rehearsal) -> None:
    plan, items = gpu_check.SMALL_PLAN, rehearsal["stages"]["tbt"]["items"]
    assert list(items) == ["stall_free", "stall_free+slo", "dynamic"]
    for r in items.values():
        assert r["complete"] and r["streams"] == plan.tbt_streams and r["long_prompt_tokens"] == plan.tbt_long
        assert 0 < r["tbt_p50_ms"] <= r["tbt_p99_ms"] <= r["tbt_max_ms"] and r["decode_only_step_ms"] > 0
    assert items["stall_free"]["stalled"] == items["stall_free+slo"]["stalled"] == 0
    # one pass prefills the whole prompt and every stream waits for it
    assert items["dynamic"]["stalled"] == plan.tbt_streams and items["dynamic"]["max_batch_prefill_tokens"] == plan.tbt_long
    slo = items["stall_free+slo"]["tbt_slo_ms"]
    assert slo == round(gpu_check.SLO_OVER_DECODE * items["stall_free"]["decode_only_step_ms"], 3)


def test_a_stage_past_its_budget_skips_and_a_failing_item_does_not_stop_the_next(tmp_path) -> None:
    path = tmp_path / "c.json"
    check = gpu_check.Check(str(path), {"device_name": "cpu"}, deadline=float("inf"), device=gpu_check.torch.device("cpu"))
    stage = check.stage("a", budget_s=60)
    stage.run("fails", lambda: 1 / 0)
    stage.run("works", lambda: {"x": 1})
    saved = json.loads(path.read_text())["stages"]["a"]
    assert saved["items"] == {"works": {"x": 1}} and "ZeroDivisionError" in saved["errors"]["fails"]
    assert saved["status"] == "errors"
    late = check.stage("b", budget_s=0)
    assert late.run("never", lambda: pytest.fail("ran past the budget")) is None
    assert json.loads(path.read_text())["stages"]["b"]["status"] == "stopped_early"


def test_runner_options_are_engine_config_fields() -> None:
    asked = {"attention_backend": "flex", "cuda_graphs": True, "compile_decode_attention": None}
    assert RunnerOptions.resolve(asked).asked == {"attention_backend": "flex", "cuda_graphs": True}
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        RunnerOptions.resolve({"attention_kernel": "flex"})


def test_a_runner_option_is_bound_while_the_engine_is_built() -> None:
    """The runner's options are EngineConfig fields: they reach the runner through the config."""
    options = RunnerOptions.resolve({"attention_backend": "sdpa", "cuda_graphs": False})
    assert options.asked == {"attention_backend": "sdpa", "cuda_graphs": False}
    model, tokenizer = gpu_check.build_model(gpu_check.SMALL, gpu_check.torch.device("cpu"))
    engine = options.build(model, tokenizer, max_batch_total_tokens=256)
    assert engine.runner.attention_backend == "sdpa" and engine.config.attention_backend == "sdpa"
    assert options.record()["runner_reports"]["attention_backend"] == "sdpa"
    assert engine.generate([[5, 6, 7]], gpu_check.stages.SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids