"""The benchmark card: wall-clock step times, the measured window, provenance, the GPU's clocks, the compile cache."""
import os
import subprocess
import sys
import time
from importlib import metadata

import pytest
import torch

from Utils.model_config import PRESETS
from Utils.results.schema import SCHEMA_VERSION
from Utils.train import nvml
from Utils.train.run import main

from conftest import REPO_ROOT, read_csv

ARGS = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic"]


def _measured_ms(prefix):
    return [float(r["step_ms"]) for r in read_csv(prefix / "results.csv") if r["warmup"] == "0"]


@pytest.mark.parametrize("additions", [["sync_every"], []], ids=["read back every 10", "read back every step"])
def test_measured_steps_add_up_to_the_window_wall_clock(tmp_path, additions):
    assert main(additions, ["--steps", "25", "--warmup", "3", "--prefix", str(tmp_path)] + ARGS) == 0
    run = read_csv(tmp_path / "runs.csv")[0]
    wall_ms = float(run["window_wall_s"]) * 1e3
    assert wall_ms > 0
    assert abs(sum(_measured_ms(tmp_path)) - wall_ms) <= 0.01 * wall_ms


def test_host_time_between_steps_counts(tmp_path, monkeypatch):
    """What the host does between two steps (here, printing each step's line) is in the next step's time."""
    import time
    pause_s = 0.03

    def slow_print(*args, **kwargs):
        time.sleep(pause_s)

    monkeypatch.setattr("Utils.train.loop.print", slow_print, raising=False)
    assert main("baseline", ["--steps", "6", "--warmup", "2", "--prefix", str(tmp_path)] + ARGS) == 0
    assert min(_measured_ms(tmp_path)) >= pause_s * 1e3


def test_a_run_records_where_its_figures_come_from(tmp_path):
    assert main("baseline", ["--steps", "4", "--warmup", "1", "--prefix", str(tmp_path)] + ARGS) == 0
    run = read_csv(tmp_path / "runs.csv")[0]
    step = read_csv(tmp_path / "results.csv")[0]
    assert run["schema_version"] == step["schema_version"] == str(SCHEMA_VERSION)
    assert run["torch_version"] == torch.__version__
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert run["git_commit"].partition("-dirty")[0] == commit
    for column, name in (("triton_version", "triton"), ("bitsandbytes_version", "bitsandbytes")):
        try:
            assert run[column] == metadata.version(name)
        except metadata.PackageNotFoundError:
            assert run[column] == ""
    # 6N (N without the position embedding) + 12 L H d T, for the tiny preset at --seq-len 16 (PaLM's count,
    # Utils/results/metrics.py): the run's own sequence length, not the model's block size.
    tiny = PRESETS["tiny"]
    n = int(run["n_params"]) - tiny.block_size * tiny.n_embd
    assert int(float(run["flops_per_token"])) == 6 * n + 12 * tiny.n_layer * tiny.n_embd * 16
    # A CPU run has no GPU to describe, and no compiled graph.
    for column in ("gpu_uuid", "driver_version", "cudnn_version", "sm_clock_mhz_median", "power_w_median",
                   "temp_c_max", "throttle_reasons", "compile_cache"):
        assert run[column] == "", column


def test_clock_samples_are_summarized():
    names = {1: "GpuIdle", 4: "SwPowerCap", 8: "HwSlowdown"}
    samples = [(1980, 500.0, 50, 0), (1755, 690.5, 61, 4), (1650, 700.0, 63, 4 | 8), (1700, 698.0, 62, 4)]
    assert nvml.clocks(samples, names).columns() == {"sm_clock_mhz_median": 1727.5, "power_w_median": 694.25,
                                                     "temp_c_max": 63, "throttle_reasons": "HwSlowdown SwPowerCap"}
    assert nvml.clocks([(1980, 500.0, 50, 0)], names).throttle_reasons == "none"
    assert nvml.clocks([], names) == nvml.Clocks()


def test_reason_names_come_from_nvml_constants():
    assert nvml.pynvml is not None, "nvidia-ml-py is in requirements.txt: install it"
    names = nvml._reason_names()
    power_cap = getattr(nvml.pynvml, "nvmlClocksEventReasonSwPowerCap",
                        getattr(nvml.pynvml, "nvmlClocksThrottleReasonSwPowerCap", None))
    assert names[power_cap] == "SwPowerCap"
    assert "All" not in names.values() and "None" not in names.values()
    assert nvml.reasons_text(power_cap, names) == ["SwPowerCap"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: NVML answers")
def test_without_nvml_the_columns_stay_blank():
    sampler = nvml.Sampler("GPU-00000000-0000-0000-0000-000000000000")
    sampler.start()
    assert sampler.stop() == nvml.Clocks()


class _FakeNVML:
    """nvidia-ml-py's calls the sampler makes, answering as one GPU at its power cap would."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
    nvmlClocksEventReasonSwPowerCap = 4

    def __init__(self):
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetClockInfo(self, handle, which):
        return 1500

    def nvmlDeviceGetPowerUsage(self, handle):
        return 300_000   # milliwatts

    def nvmlDeviceGetTemperature(self, handle, which):
        return 60

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 4


def test_the_sampler_reads_the_gpu_over_the_window_and_summarizes_it(monkeypatch):
    fake = _FakeNVML()
    monkeypatch.setattr(nvml, "pynvml", fake)
    sampler = nvml.Sampler("GPU-1")
    assert sampler.samples == []   # the sample taken to prove NVML answers is not the window's
    sampler.start()
    time.sleep(3 * nvml.SAMPLE_PERIOD_S)
    assert sampler.stop() == nvml.Clocks(sm_clock_mhz_median=1500.0, power_w_median=300.0, temp_c_max=60,
                                         throttle_reasons="SwPowerCap")
    assert len(sampler.samples) >= 2 and fake.calls == ["init", "shutdown"]


def _compile_run(prefix, cache, *extra):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    r = subprocess.run([sys.executable, "torch_compile.py", "--steps", "2", "--warmup", "1", "--prefix", str(prefix),
                        *ARGS, *extra], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    run = read_csv(prefix / "runs.csv")[-1]
    first = next(s for s in read_csv(prefix / "results.csv") if s["run_id"] == run["run_id"] and s["step"] == "0")
    # compile time: how much longer the first step took than the run's median step
    assert float(run["compile_s"]) == pytest.approx(
        max(0.0, (float(first["step_ms"]) - float(run["median_step_ms"])) / 1e3), rel=1e-4, abs=1e-5)
    return run["compile_cache"]


def test_compile_cache_is_cold_then_warm_and_cold_runs_leave_the_cache_alone(tmp_path):
    cache = tmp_path / "cache"
    assert _compile_run(tmp_path / "out", cache) == "cold"
    assert _compile_run(tmp_path / "out", cache) == "warm"
    files = sorted(p for p in cache.rglob("*"))
    assert _compile_run(tmp_path / "out", cache, "--cold") == "cold"
    assert sorted(p for p in cache.rglob("*")) == files


@pytest.mark.gpu
def test_a_gpu_run_records_its_card_and_clocks(tmp_path):
    assert main("fused", ["--steps", "30", "--batch-size", "4", "--data", "synthetic", "--prefix", str(tmp_path)]) == 0
    run = read_csv(tmp_path / "runs.csv")[0]
    assert run["gpu_uuid"].startswith("GPU-") and run["driver_version"] and run["cudnn_version"]
    assert float(run["sm_clock_mhz_median"]) > 0 and float(run["power_w_median"]) > 0
    assert run["throttle_reasons"]
    wall_ms = float(run["window_wall_s"]) * 1e3
    assert abs(sum(_measured_ms(tmp_path)) - wall_ms) <= 0.01 * wall_ms
