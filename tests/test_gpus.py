"""Utils/results/gpus.py, the one table of GPU peaks: every row reachable by its name, the right row for real
device names, and the figures in the units the suite divides by."""
import pytest

from Utils.results.gpus import GPUS, gpu_spec, peak_bandwidth, peak_bf16_flops

TERA = 1e12

# Names as torch.cuda.get_device_name() returns them, with the row each must get.
REAL_NAMES = [
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GH200 144G HBM3e", "GH200"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A800 80GB PCIe", "A800"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA RTX A6000", "A6000"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 4080", "RTX 4080"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"),
    ("NVIDIA GeForce RTX 3080", "RTX 3080"),
    ("NVIDIA GeForce RTX 3050 Ti Laptop GPU", "RTX 3050 Ti Laptop"),
    ("AMD Instinct MI300X", "MI300X"),
]


@pytest.mark.parametrize("name,fragment", REAL_NAMES)
def test_a_real_name_gets_its_own_row(name, fragment):
    assert gpu_spec(name).fragment == fragment


@pytest.mark.parametrize("name", ["Tesla T4", "Tesla V100-SXM2-16GB", "cpu", "", None,
                                  # other parts whose names hold a row's fragment: none of its figures
                                  "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 3080 Ti",
                                  "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA GB200",
                                  "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4080 Super",
                                  "NVIDIA RTX A6000X", "NVIDIA L40G"])
def test_an_unknown_gpu_has_no_figures(name):
    assert gpu_spec(name) is None
    assert peak_bf16_flops(name) is None and peak_bandwidth(name) is None


def test_a_more_specific_fragment_comes_before_the_fragment_it_contains():
    """The first fragment found in a name wins, so a row whose fragment contains an earlier one ("L40S"
    after "L40", "GH200" after "H200", "H100 PCIe" after "H100") could never be reached."""
    fragments = [g.fragment for g in GPUS]
    assert len(set(fragments)) == len(fragments)
    for i, earlier in enumerate(fragments):
        for later in fragments[i + 1:]:
            assert earlier not in later, f"{later!r} is listed after {earlier!r}, which it contains: never reached"
    for gpu in GPUS:
        assert gpu_spec(f"NVIDIA {gpu.fragment}") is gpu


def test_every_row_has_a_source_and_sane_units():
    for gpu in GPUS:
        assert gpu.source
        # FLOP/s between 10 and 5,000 TFLOP/s, bandwidth between 0.1 and 10 TB/s: a figure off by 1e3 fails.
        for rate in (gpu.bf16, gpu.tf32, gpu.fp32, gpu.fp8):
            assert rate is None or 10 * TERA <= rate <= 5000 * TERA, gpu
        assert gpu.bandwidth is None or 0.1 * TERA <= gpu.bandwidth <= 10 * TERA, gpu
        # Dense tensor-core rates: tf32 at half of bf16, never above it.
        if gpu.bf16 and gpu.tf32:
            assert gpu.tf32 <= gpu.bf16
        # FP8 at twice bf16's rate on every part that has it (Hopper, Ada, Blackwell, CDNA 3).
        if gpu.fp8:
            assert gpu.fp8 == pytest.approx(2 * gpu.bf16, rel=0.02), gpu   # datasheets round (L40S: 733, 362.05)


@pytest.mark.parametrize("name,bf16,bandwidth", [
    ("NVIDIA H200", 989.4e12, 4.8e12), ("NVIDIA H100 PCIe", 756.5e12, 2.0e12), ("NVIDIA L40S", 362.05e12, 864e9),
    ("NVIDIA L40", 181.05e12, 864e9), ("NVIDIA GH200 480GB", 989.4e12, None), ("NVIDIA A10G", 70e12, 600e9)])
def test_peaks_by_name(name, bf16, bandwidth):
    assert peak_bf16_flops(name) == pytest.approx(bf16)
    assert (peak_bandwidth(name) is None) if bandwidth is None else peak_bandwidth(name) == pytest.approx(bandwidth)
