"""FLOPs, MFU and the step-time statistics, against numbers worked out by hand."""
import pytest

from Utils.results.metrics import flops_per_token, median_iqr, mfu


def test_flops_per_token_for_gpt2_124m():
    import torch

    from Utils.model import GPT
    from Utils.model_config import PRESETS
    with torch.device("meta"):
        model = GPT(PRESETS["gpt2"])
    n = model.num_params()                       # without the position embedding
    assert n == 123_653_376
    # 6N = 741,920,256 for the weight matmuls; 12 * 12 layers * 12 heads * 64 * 1024 = 113,246,208 for QK^T and AV
    assert flops_per_token(n, 12, 12, 64, 1024) == 741_920_256 + 113_246_208


def test_mfu():
    assert mfu(1e9, 1e3, 1e15) == pytest.approx(1e-3)   # 1e12 FLOP/s achieved of 1e15
    assert mfu(855e6, 444_137, 989.4e12) == pytest.approx(0.3838, abs=1e-4)   # 855e6 x 444,137 / 989.4e12, by hand
    assert mfu(1e9, 1e3, None) is None


def test_median_iqr():
    assert median_iqr([1, 2, 3, 4]) == (2.5, 1.5)
    assert median_iqr([5.0]) == (5.0, 0.0)
    assert median_iqr([10, 1, 7, 3, 100]) == (7.0, 7.0)
