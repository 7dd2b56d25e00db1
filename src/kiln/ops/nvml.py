"""`kiln doctor`'s NVIDIA hardware checks through NVML (loaded by kiln.hardware): PCIe link, ECC, temperature,
clocks and throttling, NVLink.

Every function takes the NVML module as an argument, so the verdict logic is tested with a fake one on
machines without a GPU.
"""

from __future__ import annotations

from kiln.hardware import BAD_THROTTLE
from kiln.ops.check import Check


def _pcie(nvml, i: int, h) -> Check:
    gen, max_gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(h), nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
    width, max_width = nvml.nvmlDeviceGetCurrPcieLinkWidth(h), nvml.nvmlDeviceGetMaxPcieLinkWidth(h)
    detail = f"gen {gen}/{max_gen}, x{width}/x{max_width}"
    if width < max_width:
        return Check(
            f"gpu{i}_pcie",
            False,
            detail + ": link trained at a reduced width",
            "reseat the GPU or riser, check the slot's lanes in the BIOS; a reduced width halves host<->GPU bandwidth",
        )
    if gen < max_gen:
        # An idle GPU drops its link generation to save power; only a busy one (P0) is degraded.
        if nvml.nvmlDeviceGetPerformanceState(h) != 0:
            return Check(f"gpu{i}_pcie", True, detail + " (idle GPUs lower the link generation to save power)")
        return Check(f"gpu{i}_pcie", False, detail + ": link below its generation under load",
                     "check the BIOS PCIe speed setting and the riser; rerun doctor while the GPU is busy to confirm")
    return Check(f"gpu{i}_pcie", True, detail)


def _ecc(nvml, i: int, h) -> Check:
    try:
        bad = nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        fixed = nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)
    except nvml.NVMLError:
        return Check(f"gpu{i}_ecc", True, "ECC not supported or disabled", skipped=True)
    if bad:
        return Check(f"gpu{i}_ecc", False, f"{bad} uncorrected ECC errors since the driver loaded ({fixed} corrected)",
                     "drain this GPU: reset it (nvidia-smi -r) and report it to the operator if errors return")
    return Check(f"gpu{i}_ecc", True, f"0 uncorrected, {fixed} corrected ECC errors")


def _temperature(nvml, i: int, h, margin_c: float) -> Check:
    temp = nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
    slowdown = nvml.nvmlDeviceGetTemperatureThreshold(h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    ok = temp < slowdown - margin_c
    return Check(f"gpu{i}_temperature", ok, f"{temp} °C, slowdown at {slowdown} °C",
                 "" if ok else "check the airflow and fans; the GPU is about to slow its clocks")


def _clocks(nvml, i: int, h) -> Check:
    reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
    sm, sm_max = (
        nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
        nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM),
    )
    bad = [why for bit, why in BAD_THROTTLE.items() if reasons & bit]
    detail = f"SM clock {sm}/{sm_max} MHz" + (f"; throttled: {', '.join(bad)}" if bad else "")
    return Check(
        f"gpu{i}_clocks",
        not bad,
        detail,
        "check cooling and power delivery (nvidia-smi -q -d PERFORMANCE)" if bad else "",
    )


def _nvlink(nvml, i: int, h) -> Check:
    states = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(nvml.nvmlDeviceGetNvLinkState(h, link))
        except nvml.NVMLError:
            break  # past the last link this GPU has, or no NVLink at all
    if not states:
        return Check(f"gpu{i}_nvlink", True, "no NVLink", skipped=True)
    up = sum(s == nvml.NVML_FEATURE_ENABLED for s in states)
    # A GPU's links come up together; some up and some down means a failed link or bridge.
    ok = up == len(states) or up == 0
    return Check(f"gpu{i}_nvlink", ok, f"{up}/{len(states)} links up",
                 "" if ok else "a link is down: reseat the NVLink bridge or report the node (nvidia-smi nvlink -s)")


def gpu_checks(nvml, temp_margin_c: float = 5.0) -> list[Check]:
    checks = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        checks += [_pcie(nvml, i, h), _ecc(nvml, i, h), _temperature(nvml, i, h, temp_margin_c), _clocks(nvml, i, h),
                   _nvlink(nvml, i, h)]
    return checks
