"""The hardware probe: NVML (`nvidia-ml-py`) loaded when there is an NVIDIA driver, the driver's version, and the
throttle reasons that mean a GPU is slowed by a fault or by heat. Beside env.py (the run's fingerprint reads the
driver here); the doctor's GPU checks (ops/nvml.py) and the trainer's telemetry read the GPUs through it."""

from __future__ import annotations

# Throttle reasons that mean the GPU is slowed by a fault or by heat. Software power capping and
# sync boost are normal under full load; an idle GPU reports GpuIdle.
BAD_THROTTLE = {
    0x08: "HW slowdown (power or thermal, from the board)",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake (external power supply)",
}


def load_nvml():
    """The initialised NVML module, or None when there is no NVIDIA driver or nvidia-ml-py is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, or pynvml's NVMLError_* for a missing library or driver: no NVML here
        return None


def text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version(nvml) -> str:
    return text(nvml.nvmlSystemGetDriverVersion())
