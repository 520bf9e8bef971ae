"""A device run keeps its figures when cut short: stages cut inside at their budget, errors
recorded, the JSON rewritten whole after every stage; MBU is taken against the device's own peak."""

from __future__ import annotations

import json
import time

import pytest
import torch

from loadtests.device import check as gpu_check
from loadtests.device.peak import datasheet_tbs, peak_bandwidth
from loadtests.device.record import Cut, run_limited, save_json, time_limit


@pytest.mark.unit
def test_time_limit_cuts_the_block_in_the_middle() -> None:
    reached = []
    with pytest.raises(Cut):
        with time_limit(0.05):
            for i in range(10_000):
                reached.append(i)
                time.sleep(0.01)
    assert 0 < len(reached) < 10_000  # interrupted inside the loop, not before or after it
    with pytest.raises(Cut):
        with time_limit(0):
            pytest.fail("ran with no time left")
    with time_limit(60):  # a block that ends in time leaves no alarm behind
        pass
    time.sleep(0.05)


@pytest.mark.unit
def test_run_limited_records_complete_cut_and_error(tmp_path) -> None:
    def slow(rec):
        rec["started"] = True
        while True:
            time.sleep(0.01)

    rec: dict = {}
    assert run_limited(slow, rec, 0.05) == "cut" and rec["started"] and rec["status"] == "cut"
    rec = {}
    assert run_limited(lambda r: 1 / 0, rec, 10) == "error" and "ZeroDivisionError" in rec["error"]
    rec = {}
    assert run_limited(lambda r: r.update(x=1), rec, 10) == "complete" and rec["x"] == 1
    path = tmp_path / "a" / "r.json"
    save_json(path, {"stages": {"s": rec}})
    assert json.loads(path.read_text())["stages"]["s"]["x"] == 1 and not list(path.parent.glob("*.tmp"))


@pytest.mark.unit
def test_a_stage_cuts_the_item_at_its_budget_and_skips_the_rest(tmp_path) -> None:
    path = tmp_path / "c.json"
    check = gpu_check.Check(str(path), {"device_name": "cpu"}, deadline=float("inf"), device=torch.device("cpu"))
    stage = check.stage("a", budget_s=0.2)

    def forever():
        while True:
            time.sleep(0.01)

    assert stage.run("long", forever) is None
    assert stage.run("next", lambda: pytest.fail("ran past the budget")) is None
    saved = json.loads(path.read_text())["stages"]["a"]
    assert saved["cut"] == ["long"] and saved["skipped"] == ["next"] and saved["status"] == "cut"
    assert saved["items"] == {}


@pytest.mark.unit
def test_mbu_peak_is_the_devices_own() -> None:
    assert datasheet_tbs("NVIDIA H100 80GB HBM3") == 3.35  # SXM
    assert datasheet_tbs("NVIDIA H100 PCIe") == 2.0
    assert datasheet_tbs("NVIDIA H100 NVL") == 3.9
    assert datasheet_tbs("NVIDIA H200") == 4.8 and datasheet_tbs("NVIDIA GH200 480GB") == 4.0
    assert datasheet_tbs("NVIDIA GeForce RTX 4090") is None
    assert peak_bandwidth(torch.device("cpu")) == {"tbs": 0.1, "source": "nominal (cpu)"}
    assert peak_bandwidth(torch.device("cpu"), given_tbs=3.0) == {"tbs": 3.0, "source": "given"}


@pytest.mark.engine
def test_the_probe_cuts_a_stage_at_its_deadline_and_records_it(tmp_path) -> None:
    """A deadline shorter than the layout's compile: the layout stage is cut inside (not run to
    its end), recorded as cut with what it had, and the file is saved."""
    from loadtests.device.probe import run_probe

    out = tmp_path / "probe.json"
    result = run_probe(gpu_check.torch.device("cpu"), ("4:1", "1:1"), deadline_s=1.0, out=str(out))
    stages = json.loads(out.read_text())["probe"]["stages"]
    assert stages == result["probe"]["stages"]
    assert stages["device"]["status"] == "complete"
    assert stages["layout 4:1"]["status"] == "cut" and stages["layout 4:1"]["heads"] == "32/8"
    assert "parity_prompts" not in stages["layout 4:1"]
    assert stages["layout 1:1"]["status"] == "skipped"
    assert result["probe"]["parity_passed"] is False and result["probe"]["finished"] is True


