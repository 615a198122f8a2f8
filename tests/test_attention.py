"""The attention kernel a run records is the one its first step dispatched, and SDPA_BACKEND pins it or is refused."""
import pytest
import torch

from Utils.train import attention, compile_caches
from Utils.train.run import main

from conftest import read_csv

ARGS = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--warmup", "1"]


@pytest.mark.parametrize("operators, kernel", [
    (["aten::mm", "aten::_scaled_dot_product_flash_attention", "aten::add"], "flash2"),
    (["aten::_scaled_dot_product_cudnn_attention"], "cudnn"),
    (["aten::_scaled_dot_product_efficient_attention", "aten::_efficient_attention_forward"], "efficient"),
    (["aten::_scaled_dot_product_attention_math", "aten::softmax"], "math"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu"], "flash_cpu"),
    (["gpt_suite::packed_attention", "aten::_scaled_dot_product_cudnn_attention"], "cudnn+packed"),
    (["aten::bmm", "aten::softmax", "aten::masked_fill"], "written_out"),
])
def test_the_kernel_is_named_from_the_operators_that_ran(operators, kernel):
    assert attention.kernel_of(operators) == kernel


@pytest.mark.parametrize("backend, kernel", [("auto", "flash_cpu"), ("math", "math"), ("flash", "flash_cpu")])
def test_watch_reads_what_sdpa_ran_under_each_pin(backend, kernel):
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    with attention.Watch(torch.device("cpu")) as watch, attention.pinned(backend):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert watch.kernel() == kernel


@pytest.mark.parametrize("rung, kernel", [("baseline", "written_out"), ("flash", "flash_cpu")])
def test_a_cpu_run_records_its_attention_kernel(tmp_path, rung, kernel):
    assert main(rung, ARGS + ["--prefix", str(tmp_path)]) == 0
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["attention_kernel"] == kernel


def test_sdpa_backend_math_is_what_an_eager_sdpa_run_then_runs(tmp_path):
    assert main(["flash"], ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", "math"]) == 0
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["attention_kernel"] == "math"
    assert '"sdpa_backend": "math"' in run["config"]
    assert run["optimization"] == "baseline+flash@math"   # a row of its own beside PyTorch's choice


def test_what_torch_compile_ran_while_tracing_is_not_taken_for_the_step():
    compiled = torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    for _ in range(2):   # the first call traces, the second only runs what was compiled
        q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
        with attention.Watch(torch.device("cpu")) as watch, attention.pinned("math"):
            compiled(q, k, v).sum().backward()
        # Inductor decomposes math attention into kernels of its own: no SDPA operator runs in the step.
        assert watch.kernel() == "written_out"


@pytest.mark.gpu
def test_on_a_gpu_the_step_that_compiles_names_the_kernel_its_compiled_code_then_ran():
    # Under CUDA graphs the watched step is the first, which compiles: the operators traced are left out, the fused
    # attention that Inductor's code calls as an external kernel is read.
    compiled = torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with attention.Watch(torch.device("cuda")) as watch:
        compiled(q, k, v).sum().backward()
    assert watch.kernel() in ("flash2", "cudnn", "efficient")
    # Held to math, Inductor writes attention out in kernels of its own: the SDPA operator it traced is left out. As a
    # pinned run does, without AOTAutograd's cache, which would hand back the graph compiled above (its key is the graph
    # before SDPA picks a kernel).
    torch._dynamo.reset()
    with (attention.Watch(torch.device("cuda")) as watch, attention.pinned("math"),
          compile_caches.autograd_cache_unless(True)):
        compiled(q, k, v).sum().backward()
    assert watch.kernel() == "written_out"


def test_nothing_watched_names_no_kernel():
    assert attention.Watch(torch.device("cpu")).kernel() is None


# Under CUDA graphs the first step: the second replays the graphs, which run no operator the host sees.
@pytest.mark.parametrize("warmup, cudagraphs, watched", [(1, False, 0), (2, False, 0), (5, False, 1), (5, True, 0)])
def test_the_watched_step_is_a_warm_up_step_followed_by_one_and_read_after_the_timed_steps(tmp_path, monkeypatch,
                                                                                          warmup, cudagraphs, watched):
    # Reading the profile between two steps would land in the next step's time.
    from Utils.ladder.apply import Build
    monkeypatch.setattr(Build, "cudagraphs", property(lambda self: cudagraphs))
    seen = {"entered": [], "read_at": None}
    steps = []
    real = attention.Watch
    from Utils.train import loop

    class Spy(real):
        def __enter__(self):
            seen["entered"].append(len(steps))
            return super().__enter__()

        def kernel(self):
            seen["read_at"] = len(steps)
            return super().kernel()
    monkeypatch.setattr(loop.attention, "Watch", Spy)
    real_step = loop.make_step

    def counting(*a, **kw):
        step = real_step(*a, **kw)
        return lambda: (steps.append(1), step())[1]
    monkeypatch.setattr(loop, "make_step", counting)
    assert main("flash", ["--steps", "6", "--batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--warmup",
                          str(warmup), "--prefix", str(tmp_path)]) == 0
    assert seen == {"entered": [watched], "read_at": 6}
    assert read_csv(tmp_path / "runs.csv")[0]["attention_kernel"] == "flash_cpu"


def test_a_backend_the_device_cannot_run_is_refused_in_one_line_with_the_fix(tmp_path, capsys):
    assert main("flash", ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", "cudnn"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: SDPA_BACKEND=cudnn cannot run this run's attention (bfloat16, head size 32)")
    assert "on this CPU" in err and "use SDPA_BACKEND=auto" in err
    assert not (tmp_path / "runs.csv").exists()


def test_a_rung_whose_attention_is_written_out_ignores_the_pin(tmp_path):
    assert main("baseline", ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", "cudnn"]) == 0
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["attention_kernel"] == "written_out" and run["optimization"] == "baseline"


def test_summary_shows_each_runs_attention_kernel(tmp_path):
    from Utils.report.cli import main as plots
    for backend in ("auto", "math"):
        assert main(["flash"], ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", backend]) == 0
    assert plots(["--prefix", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "summary.md").read_text().splitlines() if line.startswith("| baseline+flash")]
    assert len(rows) == 2
    cells = [[c.strip() for c in row.split("|")] for row in rows]
    assert cells[0][-4] == "flash_cpu" and cells[1][1] == "baseline+flash@math" and cells[1][-4] == "math"


def test_an_unknown_backend_is_refused(tmp_path, capsys):
    assert main("flash", ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", "fa3"]) == 2
    assert "SDPA_BACKEND='fa3' is not one of auto, flash, cudnn, efficient, math" in capsys.readouterr().err


def test_a_compiled_rung_pinned_after_a_run_of_its_own_choice_runs_the_pinned_kernel(tmp_path):
    # The flash rung compiles; the pinned run must not get the first run's graph back from a cache.
    assert main("flash", ARGS + ["--prefix", str(tmp_path)]) == 0
    torch._dynamo.reset()   # as a new process starts: only the caches on disk are left
    assert main("flash", ARGS + ["--prefix", str(tmp_path), "--sdpa-backend", "math"]) == 0
    auto, pinned = read_csv(tmp_path / "runs.csv")
    assert auto["attention_kernel"] == "flash_cpu"
    assert pinned["optimization"] == "flash@math" and pinned["attention_kernel"] != "flash_cpu"
