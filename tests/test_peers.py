"""make peers and Utils/peers on the CPU: Hugging Face's GPT-2 trained and recorded beside the rungs, llm.c recorded
as skipped without a GPU, bad input, llm.c's pieces that need no GPU (its token file, its output, its command, its
source and toolchain checks), and the charts' marking of a peer."""
import io
import math
import os
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, add_run, clean_env, make, read_csv, summary_table
from Utils.ladder.apply import Unavailable
from Utils.model import GPT
from Utils.model_config import PRESETS
from Utils.peers import llmc
from Utils.peers.hf import HFGPT2
from Utils.report.charts import plot_speedup
from Utils.report.stats import build_report
from Utils.results.read import load

# DEVICE=cpu: the same tiny model (MODEL=auto) and the same llm.c skip on a machine that has a GPU too.
RUN = ["STEPS=4", "BATCH_SIZE=2", "DATA=synthetic", "DEVICE=cpu"]
CHARTS = ("speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png")


def make_peers(prefix, peers, *extra):
    return make(["peers", f"PREFIX={prefix}", f"PEERS={peers}", *RUN, *extra], clean_env(), timeout=600)


def peers_module(*argv):
    return subprocess.run([sys.executable, "-m", "Utils.peers", *argv], cwd=REPO_ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def test_make_peers_records_hf_in_the_suites_shape_and_goes_on_past_a_skipped_peer_naming_it(tmp_path):
    # One make peers, which trains the hf peer (torch.compile on the CPU: the slow part) and skips llm.c (no GPU).
    import transformers
    prefix = tmp_path / "out"
    done = make_peers(prefix, "llmc hf")
    assert done.returncode != 0
    assert "error: make peers: not ok: llmc (" in done.stderr
    runs = {r["optimization"]: r for r in read_csv(prefix / "runs.csv")}
    assert (runs["peer-llmc"]["status"], runs["peer-hf"]["status"]) == ("skipped", "ok")
    for name in CHARTS:
        assert (prefix / name).stat().st_size > 0, name
    run = runs["peer-hf"]
    assert run["model"] == "tiny" and f"transformers {transformers.__version__}" in run["notes"]
    with torch.device("meta"):
        assert int(run["n_params"]) == GPT(PRESETS["tiny"]).num_params(exclude_position_embedding=False)
    steps = [r for r in read_csv(prefix / "results.csv") if r["run_id"] == run["run_id"]]
    assert [(r["optimization"], r["step"]) for r in steps] == [("peer-hf", str(i)) for i in range(4)]
    assert all(math.isfinite(float(r["loss"])) and float(r["step_ms"]) > 0 for r in steps)
    assert summary_table(prefix)["peer-hf"]["status"] == "ok"


def test_hf_model_counts_parameters_as_the_suite_does_and_starts_at_chance():
    config = PRESETS["tiny"]
    torch.manual_seed(0)
    model = HFGPT2(config)
    # The tied embedding is one parameter in both models: counted twice, HF's count would be larger.
    assert model.num_params() == GPT(config).num_params()
    idx = torch.randint(0, config.vocab_size, (4, 64))
    with torch.no_grad():
        logits, loss = model(idx, idx)
    assert logits.shape == (4, 64, config.vocab_size)
    # GPT-2's init (std 0.02) gives near-uniform predictions: a loss of about ln(vocab).
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.05


def test_llmc_on_a_cpu_is_skipped_with_the_reason_and_exit_status_4(tmp_path):
    done = peers_module("llmc", "--steps", "4", "--batch-size", "2", "--data", "synthetic", "--device", "cpu",
                        "--prefix", str(tmp_path))
    assert done.returncode == 4, done.stderr
    (run,) = read_csv(tmp_path / "runs.csv")
    assert (run["optimization"], run["status"]) == ("peer-llmc", "skipped")
    assert run["message"] == "llm.c trains on a CUDA GPU only"
    assert not read_csv(tmp_path / "results.csv")


def test_a_peer_whose_loss_turns_nan_is_recorded_failed_with_its_steps(tmp_path, capsys):
    # llm.c prints "loss nan" when it diverges; its speed is then no result, as a rung's is not.
    from Utils.peers.record import run_external

    def diverging(cfg, tokens, run, log, start_sampling):
        start_sampling()
        return [(0, 10.9, 5.0), (1, 10.2, 5.0), (2, float("nan"), 5.0)], None

    args = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--device", "cpu",
            "--warmup", "1", "--prefix", str(tmp_path)]
    assert run_external("peer-llmc", args, "make peers PEERS=llmc", diverging) == 1
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["status"] == "failed" and run["message"].startswith("the loss is nan from step 2:")
    assert [r["loss"] for r in read_csv(tmp_path / "results.csv")] == ["10.9", "10.2", ""]   # nan: an empty field
    assert "error: peer-llmc failed: the loss is nan from step 2:" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["PEERS=foo"], ["PEERS=hf", "STEPS=abc"], ["PEERS=hf", "STEPS=0"],
                                  ["PEERS=hf", "NPROC=2"], ["PEERS=hf", "PROFILE=1"], ["PEERS=hf", "RUNG=warp"],
                                  ["PEERS=hf", "RUNG=max fused"], ["PEERS=hf", "REPEAT=0"]])
def test_make_peers_refuses_bad_input_before_writing(tmp_path, args):
    prefix = tmp_path / "out"
    done = make(["peers", f"PREFIX={prefix}", *RUN, *args], clean_env(), timeout=300)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert not prefix.exists()


def test_make_peers_with_a_rung_and_repeat_runs_rounds_of_the_rung_then_each_peer(tmp_path):
    # The runs are stand-ins that name themselves; the order of the commands is what is tested.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1 $2" in\n  "-m Utils.peers") echo "ran: peer $3"; exit 0;;\nesac\n'
                    f'case "$1" in\n  -m|-c) exec {sys.executable} "$@";;\n'
                    f'  plot_results.py) echo "charts drawn"; exit 0;;\n  *) echo "ran: $1"; exit 0;;\nesac\n')
    fake.chmod(0o755)
    done = make(["peers", f"PYTHON={fake}", f"PREFIX={tmp_path / 'out'}", "PEERS=llmc hf", "RUNG=max", "REPEAT=2",
                 *RUN], clean_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    ran = [ln for ln in done.stdout.splitlines() if ln.startswith("ran: ")]
    assert ran == ["ran: max_throughput.py", "ran: peer llmc", "ran: peer hf"] * 2
    assert "--- round 2 of 2 ---" in done.stdout and done.stdout.count("charts drawn") == 1


def test_make_n_peers_prints_the_commands_and_runs_none(tmp_path):
    # make -n runs the driver's line with --dry-run: it must print the peers' commands and start none, or a dry
    # run would append their rows to runs.csv.
    prefix = tmp_path / "out"
    done = make(["-n", "peers", f"PREFIX={prefix}", "PEERS=llmc hf", *RUN], clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "-m Utils.peers llmc" in done.stdout and "-m Utils.peers hf" in done.stdout
    assert "plot_results.py" in done.stdout
    assert not prefix.exists()


@pytest.mark.parametrize("argv", [[], ["foo", "--steps", "2"]])
def test_the_module_needs_a_known_peer_first(argv):
    done = peers_module(*argv)
    assert done.returncode == 2
    assert done.stderr.startswith("error: python -m Utils.peers needs a peer first, one of llmc, hf")
    assert len(done.stderr.strip().splitlines()) == 1


def test_write_tokens_writes_llmc_s_data_format(tmp_path):
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    path = tmp_path / "tokens.bin"
    llmc.write_tokens(tokens, str(path))
    assert path.stat().st_size == 1024 + 2 * len(tokens)
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert list(header[:3]) == [20240520, 1, len(tokens)] and not header[3:].any()
    assert np.fromfile(path, dtype=np.uint16, offset=1024).tolist() == tokens.tolist()


# train_gpt2.cu's step line, as it prints it.
STEP_FORMAT = ("step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)| lr %.2e | %.2f ms | %.1f%% bf16 MFU | "
               "%.0f tok/s")


def test_parse_reads_the_steps_and_memory_train_gpt2cu_prints():
    # The z-scores are nan over the first steps (no history yet): printf writes +nanz, as Python's % does.
    expected = [(0, 11.012345, 412.5), (1, 10.5, 98.25), (2, 9.87654, 97.75)]
    z = [(math.nan, math.nan), (math.nan, math.nan), (-1.25, 0.5)]
    lines = ["+-----------------------+----------------------------------------------------+",
             "| train data pattern    | tokens.bin                                         |",
             "allocated 237 MiB for model parameters",
             "device memory usage: 27915 MiB / 143771 MiB",
             "memory per sequence: 132 MiB",
             " -> estimated maximum batch size: 71",
             "val loss 10.987654"]
    for (step, loss, ms), (zl, zn) in zip(expected, z):
        lines.append(STEP_FORMAT % (step + 1, 3, loss, zl, 1.2345, zn, 6e-4, ms, 41.3, 16 * 1024 / ms * 1e3))
    lines += ["val loss 9.5", "total average iteration time: 97.998 ms"]
    assert "(+nanz)" in lines[7]
    steps, memory = llmc.parse("\n".join(lines) + "\n")
    assert steps == expected
    assert memory == pytest.approx(27915 / 1024)
    assert llmc.parse("no step lines here\n") == ([], None)


def test_sampling_starts_when_the_warm_up_steps_have_been_printed(tmp_path):
    # A stand-in for train_gpt2cu that prints four step lines, with the time each was printed: the sampler
    # must start after the second (the end of a 2-step warm-up) and before the third.
    program = tmp_path / "steps.py"
    program.write_text("import sys, time\n"
                       "for i in range(1, 5):\n"
                       f"    print({STEP_FORMAT!r} % (i, 4, 5.0, 0, 1.0, 0, 6e-4, 100.0, 40.0, 1000.0), time.monotonic(),"
                       " flush=True)\n"
                       "    time.sleep(0.2)\n"
                       "print('oops', file=sys.stderr); sys.exit(3)\n")
    started = []
    status, output = llmc.run_streamed([sys.executable, str(program)], str(tmp_path), 2,
                                       lambda: started.append(time.monotonic()))
    printed = [float(line.split()[-1]) for line in output.splitlines() if line.startswith("step")]
    assert status == 3 and output.rstrip().endswith("oops")   # stderr is kept, after stdout
    assert len(started) == 1 and printed[1] <= started[0] < printed[2]
    assert [s for s, _, _ in llmc.parse(output)[0]] == [0, 1, 2, 3]
    started.clear()
    _, output = llmc.run_streamed([sys.executable, str(program)], str(tmp_path), 0,
                                  lambda: started.append(time.monotonic()))
    first = float(output.splitlines()[0].split()[-1])
    assert len(started) == 1 and started[0] < first   # no warm-up: sampled from the start


def test_command_trains_from_random_weights_with_gelu_fused_and_no_recompute():
    args = llmc.command("/x/train_gpt2cu", "/w/tokens.bin", llmc.DESCRIPTORS["gpt2"], 16, 1024, 30)
    assert args[0] == "/x/train_gpt2cu"
    options = dict(zip(args[1::2], args[2::2]))   # every option takes one value
    assert len(args) % 2 == 1
    assert {k: options[k] for k in ("-e", "-r", "-ge", "-b", "-d", "-t", "-x", "-i")} == {
        "-e": "d12", "-r": "0", "-ge": "2", "-b": "16", "-d": "16384", "-t": "1024", "-x": "30", "-i": "/w/tokens.bin"}


def test_llmc_takes_a_micro_batch_as_its_b_and_the_whole_steps_tokens_as_its_d():
    # llm.c accumulates -d / (-b × -t) micro-batches a step: 16 rows of 1,024 tokens in micro-batches of 4
    args = llmc.command("/x/train_gpt2cu", "/w/tokens.bin", llmc.DESCRIPTORS["gpt2"], 16, 1024, 30, 4)
    options = dict(zip(args[1::2], args[2::2]))
    assert (options["-b"], options["-d"], options["-t"]) == ("4", "16384", "1024")


def test_a_peer_in_a_program_of_its_own_is_skipped_under_a_memory_cap_and_records_its_micro_batch(tmp_path,
                                                                                                   monkeypatch):
    import dataclasses
    from Utils.peers import record as record_module
    parse = record_module.parse_args
    # GPU_MEMORY_GIB is refused on a CPU by the command line: the cap is set on the parsed config
    monkeypatch.setattr(record_module, "parse_args", lambda argv, prog: dataclasses.replace(parse(argv, prog=prog),
                                                                                              gpu_memory_gib=3.5))
    trained = []
    args = ["--steps", "3", "--batch-size", "4", "--micro-batch", "2", "--seq-len", "16", "--data", "synthetic",
            "--device", "cpu", "--prefix", str(tmp_path)]
    assert record_module.run_external("peer-llmc", args, "make peers", lambda *a: trained.append(a)) == 4
    (run,) = read_csv(tmp_path / "runs.csv")
    assert not trained and run["status"] == "skipped" and "outside PyTorch's allocator" in run["message"]
    assert (run["micro_batch"], run["accumulation_steps"], run["gpu_memory_gib"]) == ("2", "2", "3.5")


def _tar_gz(path, files, top="llm.c-0123abc", **kw):
    """A tar.gz of `files` ({relative path: text}) under one top folder."""
    with tarfile.open(path, "w:gz", **kw) as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return str(path)


def test_unpack_makes_the_cuda_13_change_and_refuses_what_is_not_llmc(tmp_path):
    utils = f"static void f() {{\n    cudaCheck({llmc.OLD_ADVISE});\n}}\n"
    source = _tar_gz(tmp_path / "src.tar.gz", {"train_gpt2.cu": "int main() {}\n", "llmc/cuda_utils.cuh": utils},
                     top="whatever-name")
    (tmp_path / "a").mkdir()
    tree = llmc.unpack(source, str(tmp_path / "a"))
    assert tree == str(tmp_path / "a" / "llm.c")
    text = (tmp_path / "a" / "llm.c" / "llmc" / "cuda_utils.cuh").read_text()
    assert llmc.NEW_ADVISE in text and llmc.OLD_ADVISE not in text
    assert (tmp_path / "a" / "llm.c" / "train_gpt2.cu").is_file()
    bad = _tar_gz(tmp_path / "bad.tar.gz", {"llmc/cuda_utils.cuh": utils})
    (tmp_path / "b").mkdir()
    with pytest.raises(Unavailable, match="no train_gpt2.cu"):
        llmc.unpack(bad, str(tmp_path / "b"))


def test_the_commit_is_read_from_the_archives_pax_header(tmp_path, monkeypatch):
    sha = "f1e2ace651495b74ae22d45d1723443fd00ecd3a"
    source = _tar_gz(tmp_path / "llm.c.tar.gz", {"train_gpt2.cu": ""}, format=tarfile.PAX_FORMAT,
                     pax_headers={"comment": sha})
    assert llmc.archive_commit(source) == sha
    assert llmc.archive_commit(_tar_gz(tmp_path / "plain.tar.gz", {"train_gpt2.cu": ""})) == ""
    monkeypatch.setenv("LLMC_SOURCE", source)
    assert llmc.source_archive(str(tmp_path / "cache")) == (source, f"llm.c {sha[:12]}")


def test_a_missing_llmc_source_says_what_to_give(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_SOURCE", str(tmp_path / "nowhere.tar.gz"))
    with pytest.raises(Unavailable, match="does not exist: give an llm.c checkout or a tar.gz of one"):
        llmc.source_archive(str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()   # nothing downloaded in its place


def test_no_nvcc_anywhere_is_unavailable_naming_nvcc(tmp_path, monkeypatch):
    # Whatever this machine has (an nvcc on PATH, /usr/local/cuda*): none of it is visible to toolchain().
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CUDA_HOME", str(empty))
    with monkeypatch.context() as m:
        m.setattr(llmc.shutil, "which", lambda *a, **k: None)
        m.setattr(llmc.glob, "glob", lambda *a, **k: [])
        isdir = os.path.isdir
        m.setattr(llmc.os.path, "isdir", lambda p: not str(p).startswith("/usr/local/cuda") and isdir(p))
        with pytest.raises(Unavailable, match="no CUDA compiler: install the CUDA toolkit \\(nvcc\\)"):
            llmc.toolchain()


def test_the_speedup_chart_marks_a_peer(tmp_path):
    prefix = tmp_path / "out"
    add_run(prefix, "peer-hf")
    add_run(prefix, "baseline", (50.0, 50.5, 49.5))
    report = build_report(*load(prefix))
    assert list(report.table.index) == ["baseline", "peer-hf"]
    ax = plot_speedup(report).axes[0]
    labels = {t.get_text(): t.get_fontstyle() for t in ax.get_yticklabels()}
    assert labels == {"baseline": "normal", "hf (peer)": "italic"}
    # One bar per run, at its row (y 0: baseline, y 1: the peer): only the peer's is outlined in dashes.
    bars = {round(p.get_y() + p.get_height() / 2): p for p in ax.patches}
    assert bars[1].get_linestyle() == "--" and tuple(bars[1].get_edgecolor()) == (0.0, 0.0, 0.0, 1.0)
    assert bars[0].get_linestyle() == "solid"


@pytest.mark.gpu
def test_on_a_gpu_llmc_builds_trains_and_is_recorded(tmp_path):
    # llm.c's source comes from LLMC_SOURCE where the machine has no network (the device's calls set it).
    env = {**clean_env(), **{k: os.environ[k] for k in ("LLMC_SOURCE", "XDG_CACHE_HOME") if k in os.environ}}
    done = subprocess.run([sys.executable, "-m", "Utils.peers", "llmc", "--steps", "8", "--batch-size", "4",
                           "--prefix", str(tmp_path), "--data", "synthetic"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    run = read_csv(tmp_path / "runs.csv")[0]
    if run["status"] == "skipped" and "cannot be downloaded" in run["message"]:
        pytest.skip(run["message"])
    assert done.returncode == 0 and run["status"] == "ok", done.stderr
    steps = [r for r in read_csv(tmp_path / "results.csv") if r["run_id"] == run["run_id"]]
    assert [int(r["step"]) for r in steps] == list(range(8))
    assert all(float(r["step_ms"]) > 0 and math.isfinite(float(r["loss"])) for r in steps)
    assert run["notes"].startswith("llm.c ") and float(run["peak_mem_reserved_gib"]) > 0
