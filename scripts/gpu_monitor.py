"""The GPU's clock, power draw and temperature while a benchmark times a call.

A power-capped GPU lowers its clock under a long, heavy load (an H100 SXM at its 700 W cap ran our 256K
forward+backward at 1770 MHz against 1980 MHz idle, `benchmarks/NOTES_triton.md`, round 2 session 19), so two methods
timed minutes apart in one run may not run at the same clock. The benchmarks record, per timed call, the mean SM clock
and power and the highest temperature sampled during its timing, and the tables show the clock beside each time.

Samples come from NVML (``pynvml``, from the ``nvidia-ml-py`` package) in a background thread or, without it, from
``nvidia-smi`` run once per period: neither touches the CUDA stream the benchmark times, and on a machine without
either (or without a GPU) the monitor records nothing and the rows carry no such columns.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Callable

Sample = tuple[float, float, float]  # (SM clock MHz, power W, temperature C)


def nvml_reader(index: int) -> Callable[[], Sample] | None:
    """A function reading device ``index``'s (clock, power, temperature) through NVML, or ``None`` without pynvml."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no pynvml, no driver, no such device
        return None

    def read() -> Sample:
        return (float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)))

    return read


def smi_reader(index: int, command: str = "nvidia-smi") -> Callable[[], Sample] | None:
    """The same through one ``nvidia-smi`` query per call, or ``None`` where the command is missing."""
    path = shutil.which(command)
    if path is None:
        return None
    args = [path, "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits", "-i",
            str(index)]

    def read() -> Sample:
        text = subprocess.run(args, capture_output=True, text=True, timeout=10, check=True).stdout
        return parse_smi_line(text.strip().splitlines()[0])

    return read


def parse_smi_line(line: str) -> Sample:
    """``"1980, 123.60, 41"`` -> ``(1980.0, 123.6, 41.0)``; ``ValueError`` on anything else ("[N/A]" included)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        raise ValueError(f"expected 'clock, power, temperature', got {line!r}")
    return tuple(float(f) for f in fields)  # type: ignore[return-value]


class GpuMonitor:
    """Samples ``read()`` every ``period_s`` seconds in a daemon thread while in a ``with`` block; :meth:`window`
    summarises the samples taken between two ``time.monotonic()`` stamps. ``read=None`` picks NVML, then
    ``nvidia-smi``; if neither works, :attr:`available` is False and :meth:`window` returns ``{}``."""

    def __init__(self, index: int = 0, period_s: float = 0.2, read: Callable[[], Sample] | None = None):
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        self.period_s = period_s
        self.read = read or nvml_reader(index) or smi_reader(index)
        self.samples: list[tuple[float, Sample]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.read is not None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.read()
                self.samples.append((time.monotonic(), value))
            except Exception:  # one failed read (a timeout, "[N/A]") loses one sample, not the run
                self.errors += 1
            self._stop.wait(self.period_s)

    def __enter__(self) -> "GpuMonitor":
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def window(self, t0: float, t1: float) -> dict:
        """``{"gpu_clock_mhz", "gpu_power_w", "gpu_temp_c", "gpu_samples"}`` over the samples in ``[t0, t1]``
        (mean clock and power, highest temperature); a window shorter than a period takes the sample nearest its
        middle (within one second). ``{}`` when there is none."""
        inside = [s for t, s in self.samples if t0 <= t <= t1]
        if not inside:
            mid = (t0 + t1) / 2
            near = [(abs(t - mid), s) for t, s in self.samples if abs(t - mid) <= 1.0]
            if not near:
                return {}
            inside = [min(near, key=lambda x: x[0])[1]]
        n = len(inside)
        return dict(gpu_clock_mhz=round(sum(s[0] for s in inside) / n, 1),
                    gpu_power_w=round(sum(s[1] for s in inside) / n, 1),
                    gpu_temp_c=max(s[2] for s in inside), gpu_samples=n)
