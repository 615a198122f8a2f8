"""Several processes through torchrun, on the CPU with gloo: the same global batch as one process, the
records, a rank that fails, Ctrl-C, and the refusals that come before any process starts."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from Utils.train import distributed
from Utils.train.data import TokenLoader

from conftest import REPO_ROOT, clean_env, make, read_csv

RUN = ["DATA=synthetic", "SEQ_LEN=32", "WARMUP=1"]


def _losses(prefix):
    return [float(r["loss"]) for r in read_csv(os.path.join(prefix, "results.csv"))]


def test_ranks_read_the_global_batch_of_one_process_in_order():
    tokens = torch.arange(1000).numpy()
    one = TokenLoader(tokens, 4, 8)
    ranks = [TokenLoader(tokens, 2, 8, rank=r, world=2) for r in range(2)]
    for _ in range(40):   # past the end of the stream, where every loader starts again
        whole = one.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([parts[0][:-1], parts[1]]), whole)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The folder of one process's run on twice the batch, which the two-process runs below are held to."""
    prefix = tmp_path_factory.mktemp("one-process")
    one = make(["baseline", "STEPS=5", "BATCH_SIZE=4", f"PREFIX={prefix}"] + RUN, clean_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    return prefix


@pytest.mark.parametrize("parallel, micro", [("ddp", []), ("fsdp", []), ("ddp", ["MICRO_BATCH=1"])])
def test_two_processes_train_as_one_process_on_twice_the_batch(tmp_path, one_process, parallel, micro):
    # With MICRO_BATCH=1 each rank accumulates two micro-batches and reduces the gradients once, in the last.
    two = make(["baseline", "STEPS=5", "BATCH_SIZE=2", f"PREFIX={tmp_path / 'two'}", "NPROC=2",
                f"PARALLEL={parallel}"] + micro + RUN, clean_env(), timeout=300)
    assert two.returncode == 0, two.stderr
    # results.csv keeps 6 significant digits (steps of 1e-4 at a loss near 10.8), and the two runs' sums may
    # differ by about 1e-6 before that rounding: one step apart at most. Another split of the batch moves the
    # losses by about 1e-2.
    assert _losses(tmp_path / "two") == pytest.approx(_losses(one_process), abs=2e-4)
    runs = read_csv(tmp_path / "two" / "runs.csv")
    assert len(runs) == 1, "rank 0 alone records the run"
    run = runs[0]
    assert (run["nproc"], run["nnodes"], run["parallel"], run["batch_size"]) == ("2", "1", parallel, "2")
    steps = read_csv(tmp_path / "two" / "results.csv")
    last = steps[-1]
    assert float(last["tokens_per_s"]) == pytest.approx(2 * 2 * 32 / (float(last["step_ms"]) / 1e3), rel=1e-4)
    # both ranks' rows: 2 processes x 2 rows x 32 tokens a step, at the run's median step
    assert float(run["global_tokens_per_s"]) == pytest.approx(2 * 2 * 32 / (float(run["median_step_ms"]) / 1e3),
                                                              rel=1e-4)
    assert float(run["tokens_per_s_per_gpu"]) == pytest.approx(float(run["global_tokens_per_s"]) / 2, rel=1e-5)
    assert read_csv(one_process / "runs.csv")[0]["nproc"] == "1"
    assert (run["micro_batch"], run["accumulation_steps"]) == (("1", "2") if micro else ("2", "1"))


def test_compiled_ddp_runs(tmp_path):
    r = make(["torch_compile", "STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}", "NPROC=2"] + RUN, clean_env(),
             timeout=600)
    assert r.returncode == 0, r.stderr
    run = read_csv(tmp_path / "runs.csv")[0]
    assert run["status"] == "ok" and run["parallel"] == "ddp" and run["compile_cache"]


def _fail_rank(tmp_path, rank):
    """A sitecustomize that makes rank `rank`'s third optimizer step raise."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"""
import os
if os.environ.get("RANK") == "{rank}":
    import torch
    _step, _calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 3:
            raise RuntimeError("injected failure")
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
""")
    return str(folder)


def test_a_failing_rank_ends_the_run_and_is_named(tmp_path):
    env = dict(clean_env(), PYTHONPATH=_fail_rank(tmp_path, 1))
    prefix = tmp_path / "out"
    r = make(["baseline", "STEPS=20", "BATCH_SIZE=2", f"PREFIX={prefix}", "NPROC=2"] + RUN, env, timeout=300)
    assert r.returncode != 0
    run = read_csv(prefix / "runs.csv")[0]
    assert run["status"] == "failed"
    assert run["message"].startswith("rank 1: RuntimeError: injected failure")
    assert not [n for n in os.listdir(prefix) if n.startswith(".rank-failure-")]
    assert os.path.exists(prefix / f"{run['run_id']}.rank1.error.log")


def test_ctrl_c_stops_every_rank_at_one_step_and_keeps_every_ranks_part_of_the_steps(tmp_path):
    cmd = ["make", "--no-print-directory", f"PYTHON={sys.executable}", "baseline", "STEPS=2000", "BATCH_SIZE=2",
           f"PREFIX={tmp_path / 'stopped'}", "NPROC=2"] + RUN
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=dict(clean_env(), PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    for line in proc.stdout:
        if line.startswith("step 3/") or time.time() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in a terminal does: every process of the group
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    assert "Traceback" not in out and "error: run baseline stopped by SIGINT" in out.splitlines(), out
    runs = read_csv(tmp_path / "stopped" / "runs.csv")
    assert len(runs) == 1 and runs[0]["status"] == "interrupted"
    kept = len(read_csv(tmp_path / "stopped" / "results.csv"))
    assert int(runs[0]["steps"]) == 2000 and kept >= 3
    # Each kept step is the run's, not rank 0's alone: its loss is the mean over both ranks' shares, as the same
    # steps of a run that was not stopped record it.
    whole = make(["baseline", f"STEPS={kept}", "BATCH_SIZE=2", f"PREFIX={tmp_path / 'whole'}", "NPROC=2"] + RUN,
                 dict(clean_env(), OMP_NUM_THREADS="1"), timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert _losses(tmp_path / "stopped") == pytest.approx(_losses(tmp_path / "whole"), abs=2e-4)


def test_steps_the_ranks_cannot_agree_on_are_not_kept(monkeypatch):
    from Utils.train import loop
    from Utils.train.record import Run
    monkeypatch.setattr(distributed, "common_steps", lambda *a: None)   # rank 1 gone, or held in a collective
    rows = [{"step_ms": 10.0, "loss": 2.0, "tokens_per_s": 1.0, "mfu": None}] * 3
    run = Run(run_id="r", optimization="baseline", started_at="", steps=9, warmup_steps=1, batch_size=2, seq_len=8,
              model="tiny", data="synthetic", command="", config="{}", nproc=2)
    loop._common_steps(rows, run)
    assert rows == [] and run.message.startswith("interrupted after 3 of rank 0's steps; another rank did not "
                                                 "answer within 10 s, so no step is kept")


@pytest.mark.parametrize("args, error", [
    (["NPROC=0"], "error: NPROC='0' is not a number of processes"),
    (["NPROC=two"], "error: NPROC='two' is not a number of processes"),
    (["NPROC=1 2"], "error: NPROC='1 2' is not a number of processes"),   # several are make scaling's
    (["NPROC=2", "PARALLEL=zero"], "error: PARALLEL='zero' is not one of ddp, fsdp"),
    (["NPROC=2", "DEVICE=cuda"], "error: DEVICE=cuda but PyTorch sees no CUDA GPU here"),
    (["NPROC=2", "SEED=-1"], "error: SEED='-1' is not an integer"),   # the run's own checks, before torchrun too
])
def test_bad_process_settings_are_refused_before_any_process_starts(tmp_path, args, error):
    if "DEVICE=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = make(["fused", "STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}"] + RUN + args, clean_env(), timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith(error) and "torch.distributed.run" not in r.stdout
    assert not os.path.exists(tmp_path / "runs.csv")


def test_an_addition_fsdp_cannot_run_is_refused_with_the_fix(tmp_path):
    r = make(["max", "STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}", "NPROC=2", "PARALLEL=fsdp"] + RUN,
             clean_env(), timeout=120)
    assert r.returncode == 2
    line = r.stderr.splitlines()[0]
    assert "cannot run with PARALLEL=fsdp" in line and "use PARALLEL=ddp" in line
    assert not os.path.exists(tmp_path / "runs.csv")


def test_more_processes_than_gpus_is_refused():
    assert distributed.check("3", "ddp", "auto", gpus=2) == \
        "NPROC=3 but this machine has 2 GPUs: use NPROC=2 or fewer (one process per GPU)"
    assert distributed.check("2", "ddp", "auto", gpus=2) is None
    assert distributed.check("4", "ddp", "cpu", gpus=2) is None   # CPU processes are not GPUs


def test_parallel_without_torchrun_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "fused_optimizer.py", "--parallel", "ddp", "--steps", "3", "--batch-size",
                        "2", "--prefix", str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: PARALLEL=ddp runs under torchrun: use make <rung> NPROC=n PARALLEL=ddp")


def test_make_scaling_runs_the_rung_at_each_count_and_draws_the_chart(tmp_path):
    r = make(["scaling", "RUNG=baseline", "NPROC=1 2", "STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}"] + RUN,
             clean_env(), timeout=600)
    assert r.returncode == 0, r.stderr
    runs = read_csv(tmp_path / "runs.csv")
    assert [(run["nproc"], run["parallel"]) for run in runs] == [("1", "ddp"), ("2", "ddp")]
    assert os.path.exists(tmp_path / "scaling.png")
    assert "## Scaling" in (tmp_path / "summary.md").read_text()
    bad = make(["scaling", "RUNG=turbo", "NPROC=1 2", "STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}"], clean_env(),
               timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: RUNG must name one rung")


@pytest.mark.gpu
@pytest.mark.parametrize("rung", ["fused", "max"])
def test_ddp_on_one_gpu_runs_every_addition_of_the_rung(tmp_path, rung):
    r = make([rung, "STEPS=12", "BATCH_SIZE=4", f"PREFIX={tmp_path}", "NPROC=1", "PARALLEL=ddp", "DATA=synthetic"],
             clean_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    run = read_csv(tmp_path / "runs.csv")[0]
    assert (run["status"], run["nproc"], run["parallel"]) == ("ok", "1", "ddp")
    assert run["gpu_uuid"].startswith("GPU-")


def _reduce_on_rank(rank, init_file, out_folder):
    import torch.distributed as td
    from Utils.train.distributed import reduce_steps
    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # rank 1 is slower at step 0 and faster at step 1; its window longer; their losses differ
        steps = [[10.0, 30.0], [20.0, 5.0]][rank]
        losses = [[1.0, 3.0], [2.0, 5.0]][rank]
        result = reduce_steps(steps, losses, [1.0, 2.5][rank], torch.device("cpu"))
        (out_folder / f"{rank}.json").write_text(json.dumps(result))
    finally:
        td.destroy_process_group()


def test_each_step_is_the_slowest_ranks_and_each_loss_the_mean_over_ranks(tmp_path):
    torch.multiprocessing.spawn(_reduce_on_rank, args=(str(tmp_path / "init"), tmp_path), nprocs=2)
    expected = [[20.0, 30.0], [1.5, 4.0], 2.5]
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)] == [expected, expected]
