"""make peak: this machine's bf16 matmul rate and copy bandwidth, appended to PREFIX/peak.csv, and read back
as the second MFU denominator (Utils.results.read.load_peak, measured_peak)."""
import os

import pytest
import torch

from conftest import clean_env, make
from Utils.results.read import load_peak, measured_peak
from Utils.results.schema import PEAK_COLUMNS, PEAK_FILE, SCHEMA_VERSION
from Utils.results.store import append_rows
from Utils import peak
from Utils.peak import DEFAULTS, main

TINY = ["--device", "cpu", "--matmul-n", "32", "--copy-gib", str(64 / 2**20)]   # 64 KiB


def _files(folder):
    """{name: bytes} of every file in folder, to prove a refusal changed nothing."""
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def _peak_row(gpu_name, gpu_uuid, tflops):
    return {"measured_at": "2026-01-01T00:00:00+00:00", "device": "cuda", "gpu_name": gpu_name,
            "gpu_uuid": gpu_uuid, "torch_version": "2.11.0", "git_commit": "abc", "matmul_n": 8192,
            "matmul_tflops": tflops, "copy_gib": 2.0, "copy_gb_s": 4300.0}


def test_the_cpu_defaults_append_a_row_with_positive_rates(tmp_path, capsys):
    assert main(["--prefix", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "TFLOP/s" in out and "GB/s" in out and "datasheet" not in out
    peaks = load_peak(tmp_path)
    assert len(peaks) == 1
    row = peaks.iloc[0]
    assert (row.device, row.gpu_name, row.gpu_uuid) == ("cpu", "cpu", "")
    assert (row.matmul_n, row.copy_gib) == (DEFAULTS["cpu"][0], pytest.approx(DEFAULTS["cpu"][1]))
    assert row.matmul_tflops > 0 and row.copy_gb_s > 0
    assert row.torch_version == torch.__version__ and row.schema_version == SCHEMA_VERSION and row.measured_at


def test_a_second_measurement_appends_a_second_row(tmp_path):
    assert main(["--prefix", str(tmp_path)] + TINY) == 0
    first = (tmp_path / PEAK_FILE).read_bytes()
    assert main(["--prefix", str(tmp_path)] + TINY) == 0
    assert (tmp_path / PEAK_FILE).read_bytes().startswith(first)
    peaks = load_peak(tmp_path)
    assert list(peaks.matmul_n) == [32, 32] and (peaks.matmul_tflops > 0).all() and (peaks.copy_gb_s > 0).all()


@pytest.mark.parametrize("args,says", [
    (["--matmul-n", "0"], "MATMUL_N='0' is not a positive integer"),
    (["--matmul-n", "1.5"], "MATMUL_N='1.5' is not a positive integer"),
    (["--copy-gib", "-1"], "COPY_GIB='-1' is not a positive number"),
    (["--copy-gib", "nan"], "COPY_GIB='nan' is not a positive number"),
    (["--copy-gib", "1e-12"], "one byte at least"),
    (["--matmul-n", "100000000000000000000"], "MATMUL_N=100000000000000000000 is larger than 65,536"),
    (["--copy-gib", "1e30"], "COPY_GIB=1e30 is larger than 1,024 GiB"),
    (["--device", "tpu"], "DEVICE='tpu' is not one of auto, cuda, cpu"),
    (["--prefix", " "], "PREFIX is empty"),
    (["--bogus"], "unrecognized arguments"),
])
def test_a_bad_argument_is_refused_in_one_line_and_changes_nothing(tmp_path, capsys, args, says):
    append_rows(tmp_path, PEAK_FILE, PEAK_COLUMNS, [_peak_row("NVIDIA H200", "GPU-1", 800.0)])
    before = _files(tmp_path)
    assert main(["--prefix", str(tmp_path), "--device", "cpu"] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    assert _files(tmp_path) == before


def test_a_missing_prefix_is_refused_before_a_folder_is_made(tmp_path, capsys):
    assert main(["--prefix", str(tmp_path / "new"), "--matmul-n", "0"]) == 2
    assert "MATMUL_N" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    assert main(["--prefix", str(tmp_path), "--device", "cuda"]) == 2
    assert "DEVICE=cuda but PyTorch sees no CUDA GPU" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_an_unwritable_prefix_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    assert main(["--prefix", str(blocker / "out")] + TINY) == 2
    err = capsys.readouterr().err
    assert f"PREFIX={blocker / 'out'} cannot be written" in err and len(err.strip().splitlines()) == 1
    assert _files(tmp_path) == {"a_file": b"keep me"}


def test_a_folder_where_peak_csv_goes_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / PEAK_FILE).mkdir()
    assert main(["--prefix", str(tmp_path)] + TINY) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {tmp_path / PEAK_FILE} is not a file: move it aside or use another "
                                        f"PREFIX"]


@pytest.mark.parametrize("content,says", [
    (b"a,b\n1,2\n", "not the suite's peak.csv header"),
    (",".join(PEAK_COLUMNS).encode() + b"\n2026,cuda", "ends in the middle of a row"),
])
def test_a_foreign_or_cut_off_peak_file_is_refused_and_kept(tmp_path, capsys, content, says):
    (tmp_path / PEAK_FILE).write_bytes(content)
    before = _files(tmp_path)
    assert main(["--prefix", str(tmp_path)] + TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    assert _files(tmp_path) == before


def test_load_peak_is_none_without_a_peak_file(tmp_path):
    assert load_peak(tmp_path) is None


def test_measured_peak_prefers_the_same_card_then_the_same_name(tmp_path):
    append_rows(tmp_path, PEAK_FILE, PEAK_COLUMNS, [
        _peak_row("NVIDIA H200", "GPU-b", 780.0),
        _peak_row("NVIDIA H200", "GPU-b", 800.0),   # the same card again, later: the one that counts
        _peak_row("NVIDIA H200", "GPU-c", 810.0),
        _peak_row("NVIDIA H100 80GB HBM3", "GPU-a", 700.0),
        _peak_row("cpu", "", 0.1),
    ])
    peaks = load_peak(tmp_path)
    assert measured_peak(peaks, "NVIDIA H200", "GPU-b").matmul_tflops == 800.0
    assert measured_peak(peaks, "NVIDIA H200", "GPU-z").matmul_tflops == 810.0   # another H200: the latest
    assert measured_peak(peaks, "NVIDIA H200").matmul_tflops == 810.0
    assert measured_peak(peaks, "NVIDIA H100 80GB HBM3", "").matmul_tflops == 700.0
    assert measured_peak(peaks, "NVIDIA A100-SXM4-80GB", "GPU-y") is None
    assert measured_peak(peaks, "", "") is None   # a blank uuid or name matches nothing
    assert measured_peak(None, "NVIDIA H200", "GPU-b") is None


def test_make_peak_end_to_end_and_make_reset_removes_it(tmp_path):
    env = {k: v for k, v in clean_env().items() if k not in ("MATMUL_N", "COPY_GIB")}
    prefix = tmp_path / "out dir"
    for _ in range(2):
        r = make(["peak", f"PREFIX={prefix}", "DEVICE=cpu", "MATMUL_N=32", f"COPY_GIB={64 / 2**20}"], env)
        assert r.returncode == 0, r.stderr
        assert f"-> {prefix / PEAK_FILE}" in r.stdout
    peaks = load_peak(prefix)
    assert list(peaks.device) == ["cpu", "cpu"] and list(peaks.matmul_n) == [32, 32]
    r = make(["peak", f"PREFIX={prefix}", "DEVICE=cpu", "MATMUL_N=0"], env)
    assert r.returncode == 2 and [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")] == [
        "error: MATMUL_N='0' is not a positive integer: pass the matmul's side, e.g. MATMUL_N=8192"]
    assert len(load_peak(prefix)) == 2
    r = make(["reset", f"PREFIX={prefix}"], env)
    assert r.returncode == 0, r.stderr
    assert not (prefix / PEAK_FILE).exists()


@pytest.mark.gpu
def test_the_cuda_defaults_reach_a_real_gpus_rates(tmp_path):
    assert main(["--prefix", str(tmp_path), "--device", "cuda"]) == 0
    row = load_peak(tmp_path).iloc[0]
    assert row.device == "cuda" and row.gpu_uuid.startswith("GPU-")
    assert (row.matmul_n, row.copy_gib) == DEFAULTS["cuda"]
    assert row.matmul_tflops > 100, row.matmul_tflops
    assert row.copy_gb_s > 500, row.copy_gb_s


def test_the_rates_are_the_flops_and_bytes_moved_over_the_median_time(monkeypatch):
    """With the timer fixed, each rate is exactly the work done over that time."""
    monkeypatch.setattr(peak, "_median_seconds", lambda fn, device: 0.25)
    rates = peak.measure(torch.device("cpu"), 32, 64 / 2**20)
    # An n x n @ n x n matmul does n^3 multiply-adds, 2 n^3 FLOPs: 2 * 32^3 / 0.25 s / 1e12 TFLOP/s.
    assert rates["matmul_tflops"] == pytest.approx(2 * 32**3 / 0.25 / 1e12, rel=1e-12)
    # A copy of 64 KiB reads and writes each byte once, 2 * 65536 bytes: / 0.25 s / 1e9 GB/s.
    assert rates["copy_gb_s"] == pytest.approx(2 * 65536 / 0.25 / 1e9, rel=1e-12)
    assert (rates["matmul_n"], rates["copy_gib"]) == (32, 64 / 2**20)
