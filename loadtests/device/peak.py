"""The device's own peak memory bandwidth, the denominator of decode MBU.

From the device's name where its datasheet figure is known (an H100 SXM reads 3.35 TB/s, an H200
4.8: one figure for every device read an H100's MBU 30% low), else from a device-to-device copy
measured here (a copy reads and writes each byte: 2 x bytes / time; it reaches 85-90% of the
datasheet on HBM parts, so MBU against it reads a little high). The JSON says which.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# (substring of torch.cuda.get_device_name, TB/s), first match wins: the specific names first.
DATASHEET_TBS: tuple[tuple[str, float], ...] = (
    ("GH200", 4.0),  # before "H200", which it contains
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # the 40 GB parts
    ("L40S", 0.864),
    ("L4", 0.3),
)
CPU_TBS = 0.1  # a nominal figure: the CPU rehearsal checks the arithmetic, not the machine


def datasheet_tbs(name: str) -> float | None:
    return next((tbs for key, tbs in DATASHEET_TBS if key in name), None)


def copy_tbs(device: torch.device, mib: int = 1024, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in TB/s (read + write), median of `repeats`."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    times.sort()
    return 2 * src.numel() / times[len(times) // 2] / 1e12


def peak_bandwidth(device: torch.device, given_tbs: float | None = None,
                   measure: bool = True) -> dict[str, Any]:
    """{"tbs": the peak MBU is taken against, "source": "given" | "datasheet: NAME" |
    "measured copy" | "nominal (cpu)", "copy_tbs": the measured copy (when measured)}."""
    out: dict[str, Any] = {}
    if measure and device.type == "cuda":
        out["copy_tbs"] = round(copy_tbs(device), 3)
    if given_tbs is not None:
        return out | {"tbs": given_tbs, "source": "given"}
    if device.type != "cuda":
        return out | {"tbs": CPU_TBS, "source": "nominal (cpu)"}
    name = torch.cuda.get_device_name(device)
    sheet = datasheet_tbs(name)
    if sheet is not None:
        return out | {"tbs": sheet, "source": f"datasheet: {name}"}
    if "copy_tbs" not in out:
        out["copy_tbs"] = round(copy_tbs(device), 3)
    return out | {"tbs": out["copy_tbs"], "source": f"measured copy ({name} not in the table)"}
