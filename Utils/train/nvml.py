"""The GPU's SM clock, power, temperature and throttle reasons over a run's measured steps, through NVML
(nvidia-ml-py), and the driver's version.

A card at its power cap or hot runs its clock lower and every step slower by a few percent, which looks like
a change of code when two runs are compared. A thread beside the training loop reads NVML every
SAMPLE_PERIOD_S: off the timed path (the loop never waits for it; ctypes lets go of the GIL during each
NVML call), and with at least a sample at the window's start and one at its end. Where NVML cannot be
loaded (no NVIDIA driver, nvidia-ml-py missing), the columns stay blank and the run goes on.
"""
import statistics
import threading
from dataclasses import asdict, dataclass

try:
    import pynvml
except ImportError:   # nvidia-ml-py is in requirements.txt; a run without it only loses these columns
    pynvml = None

SAMPLE_PERIOD_S = 0.05


@dataclass(frozen=True)
class Clocks:
    """The GPU over a run's measured steps: runs.csv's clock columns, one field each; blank without samples."""
    sm_clock_mhz_median: float | None = None
    power_w_median: float | None = None
    temp_c_max: float | None = None
    throttle_reasons: str | None = None   # space-separated; "none" where samples saw none

    def columns(self) -> dict[str, float | str | None]:
        return asdict(self)


def _reason_names() -> dict[int, str]:
    """{bit: name} of NVML's clock event reasons, from nvidia-ml-py's own constants
    (nvmlClocksEventReasonSwPowerCap -> SwPowerCap); older releases call them throttle reasons."""
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        names = {getattr(pynvml, n): n.removeprefix(prefix) for n in dir(pynvml)
                 if n.startswith(prefix) and n.removeprefix(prefix) not in ("All", "None", "Unknown")}
        if names:
            return names
    return {}


def reasons_text(mask: int, names: dict[int, str]) -> list[str]:
    """The names of the bits set in an NVML clock event reasons mask."""
    return [name for bit, name in sorted(names.items()) if bit and mask & bit == bit]


def driver_version() -> str:
    """The NVIDIA driver's version, or blank where NVML cannot be loaded."""
    if pynvml is None:
        return ""
    try:
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)


class Sampler:
    """start() and stop() bracket the measured steps of one GPU, named by its UUID; stop() returns the
    Clocks summarizing the samples, blank where NVML gave none."""

    def __init__(self, uuid: str):
        self.samples: list[tuple[float, float, float, int]] = []
        self.handle, self._thread, self._done = None, None, threading.Event()
        if pynvml is None or not uuid:
            return
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            self._reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            self._sample()
        except pynvml.NVMLError:
            self.handle = None
        self.samples.clear()

    def _sample(self):
        h = self.handle
        self.samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                             pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,   # milliwatts
                             pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                             self._reasons_of(h)))

    def _loop(self):
        while True:
            try:
                self._sample()
            except pynvml.NVMLError:
                return
            if self._done.wait(SAMPLE_PERIOD_S):
                return

    def start(self) -> None:
        if self.handle is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> Clocks:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
            try:
                self._sample()   # the window's end
            except pynvml.NVMLError:
                pass
        if self.handle is not None:
            self.handle = None
            pynvml.nvmlShutdown()
        return clocks(self.samples, _reason_names() if pynvml else {})


def clocks(samples: list[tuple[float, float, float, int]], names: dict[int, str]) -> Clocks:
    """The Clocks of (sm clock MHz, power W, temperature C, reasons mask) samples, `names` naming the bits."""
    if not samples:
        return Clocks()
    sm, power, temps, masks = zip(*samples)
    seen = {name for mask in masks for name in reasons_text(mask, names)}
    return Clocks(sm_clock_mhz_median=statistics.median(sm), power_w_median=statistics.median(power),
                  temp_c_max=max(temps), throttle_reasons=" ".join(sorted(seen)) or "none")
