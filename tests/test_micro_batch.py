"""Gradient accumulation: BATCH_SIZE rows a step in micro-batches of MICRO_BATCH give the whole batch's gradients
and losses, bad values are refused, and MICRO_BATCH=auto's search keeps the largest micro-batch that fits."""
import pytest
import torch

from Utils.ladder.apply import build
from Utils.model_config import PRESETS
from Utils.train import distributed
from Utils.train.cli import UsageError, parse_args
from Utils.train.data import TokenLoader, load_tokens
from Utils.train.failures import out_of_memory
from Utils.train.loop import StepClock, make_step
from Utils.train.micro import PROBE_STEPS, NothingFits, _probe, search
from Utils.train.run import main

from conftest import read_csv

CPU = torch.device("cpu")
ARGS = ["--seq-len", "16", "--data", "synthetic", "--warmup", "1"]
# Every recipe that runs on a CPU without compiling (each micro-batch size would compile anew), and one that
# compiles. bf16 autocast rounds each micro-batch's matmuls to bf16: its gradients agree to bf16's rounding.
RECIPES = [(("tf32",), 1e-5), (("tf32", "bf16"), 2e-2), (("tf32", "bf16", "flash"), 2e-2), (("fused",), 1e-5),
           (("8bit",), 1e-5), (("bf16", "flash", "loss", "fold_norm", "gemm_bias_grad"), 2e-2),
           (("torch_compile",), 1e-5)]


def _config(**kw):
    args = ["--steps", "4", "--batch-size", "4", "--prefix", "unused"] + ARGS
    return parse_args(args + sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), []))


def _gradients(additions, micro, device=CPU, steps=1):
    """The gradients of the last of `steps` steps of 4 rows in micro-batches of `micro`, taken where the optimizer
    would step (it does not: every step starts from the same weights)."""
    cfg = _config(micro_batch=micro)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    b = build(additions, device, PRESETS[cfg.model], cfg.seed, TokenLoader(tokens, 4, cfg.seq_len))
    taken = {}
    b.update = lambda: taken.update({n: p.grad.detach().float().clone() for n, p in b.model.named_parameters()
                                     if p.grad is not None})
    step = make_step(b, cfg, StepClock(device))
    for _ in range(steps):
        step()
    return taken


def _relative_errors(parts, whole):
    # relative to the gradient's own size: a single element near zero carries no tolerance of its own
    assert whole and parts.keys() == whole.keys()
    return {name: float((parts[name] - g).norm() / g.norm().clamp_min(1e-12)) for name, g in whole.items()}


@pytest.mark.parametrize("additions, rtol", RECIPES, ids=["+".join(r[0]) for r in RECIPES])
def test_micro_batches_of_1_2_and_4_give_the_whole_batchs_gradients(additions, rtol):
    whole = _gradients(additions, 4)
    for micro in (1, 2) if "torch_compile" not in additions else (2,):
        errors = _relative_errors(_gradients(additions, micro), whole)
        assert max(errors.values()) < rtol, (micro, errors)


# On a GPU, the compiled rungs as they run: CUDA graphs recorded in the second step and replayed in the third (the
# gradients compared are the third's), FP8 scales taken per micro-batch (their rounding differs from the whole
# batch's, hence max's looser bound; a lost or doubled micro-batch is an error near 50% or 100%).
GPU_RUNGS = [("fused", 2e-2), ("max", 6e-2)]


@pytest.mark.gpu
@pytest.mark.parametrize("rung, rtol", GPU_RUNGS, ids=[r[0] for r in GPU_RUNGS])
def test_on_a_gpu_each_compiled_rung_accumulates_the_whole_batchs_gradients(rung, rtol):
    from Utils.ladder.registry import RUNGS
    cuda = torch.device("cuda")
    additions = RUNGS[rung].additions
    whole = _gradients(additions, 4, cuda, steps=3)
    for micro in (1, 2):
        errors = _relative_errors(_gradients(additions, micro, cuda, steps=3), whole)
        print(rung, micro, f"largest relative error {max(errors.values()):.2e}")
        assert max(errors.values()) < rtol, (micro, errors)


def test_a_four_step_run_ends_at_the_same_loss_in_any_micro_batch(tmp_path):
    finals = {}
    for micro in (1, 2, 4):
        prefix = tmp_path / str(micro)
        assert main("baseline", ["--steps", "4", "--batch-size", "4", "--prefix", str(prefix), "--micro-batch",
                                 str(micro)] + ARGS) == 0
        (run,) = read_csv(prefix / "runs.csv")
        assert (run["micro_batch"], run["accumulation_steps"]) == (str(micro), str(4 // micro))
        finals[micro] = float(run["final_loss"])
    assert finals[1] == pytest.approx(finals[4], rel=1e-5) and finals[2] == pytest.approx(finals[4], rel=1e-5)


def test_auto_on_a_cpu_is_the_whole_batch(tmp_path):
    assert main("baseline", ["--steps", "2", "--batch-size", "4", "--prefix", str(tmp_path)] + ARGS) == 0
    (run,) = read_csv(tmp_path / "runs.csv")
    assert (run["micro_batch"], run["accumulation_steps"], run["gpu_memory_gib"]) == ("4", "1", "")


@pytest.mark.parametrize("argv, error", [
    (["--micro-batch", "7"], "MICRO_BATCH=7 does not divide BATCH_SIZE=12: use 6 or 12 (or MICRO_BATCH=auto)"),
    (["--micro-batch", "5"], "MICRO_BATCH=5 does not divide BATCH_SIZE=12: use 4 or 6"),
    (["--micro-batch", "24"], "MICRO_BATCH=24 does not divide BATCH_SIZE=12: use 12 (or"),
    (["--micro-batch", "0"], "MICRO_BATCH='0' is not a positive integer"),
    (["--micro-batch", "two"], "MICRO_BATCH='two' is not a positive integer"),
    (["--gpu-memory-gib", "3.5"], "GPU_MEMORY_GIB=3.5 caps a GPU's memory, and this run is on the CPU"),
])
def test_bad_micro_batches_and_memory_caps_are_refused_with_the_fix(argv, error):
    with pytest.raises(UsageError) as e:
        parse_args(["--steps", "4", "--batch-size", "12", "--prefix", "p", "--device", "cpu"] + argv)
    assert str(e.value).startswith(error)


def test_make_refuses_a_micro_batch_that_does_not_divide_in_one_line(tmp_path, suite_env):
    from conftest import make
    r = make(["fused", "STEPS=2", "BATCH_SIZE=6", "MICRO_BATCH=4", f"PREFIX={tmp_path}"], suite_env, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and errors == ["error: MICRO_BATCH=4 does not divide BATCH_SIZE=6: use 3 or 6 "
                                            "(or MICRO_BATCH=auto)"]
    assert not (tmp_path / "runs.csv").exists()


def _fake_memory(monkeypatch, rows_that_fit):
    """The model runs out of memory, as CUDA's allocator says so, on a micro-batch of more rows than fit."""
    from Utils.model import GPT
    forward = GPT.forward

    def limited(self, idx, targets=None):
        if idx.shape[0] > rows_that_fit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {idx.shape[0]} rows")
        return forward(self, idx, targets)
    monkeypatch.setattr(GPT, "forward", limited)


def _search(additions, batch, monkeypatch, rows_that_fit, say=lambda line: None):
    _fake_memory(monkeypatch, rows_that_fit)
    cfg = parse_args(["--steps", "4", "--batch-size", str(batch), "--prefix", "p"] + ARGS)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    dist = distributed.from_env("")
    return search(batch, lambda m: _probe(additions, cfg, m, CPU, tokens, dist, None, {}), out_of_memory, CPU, say)


# The whole batch first, then a binary search of the smaller divisors: too_large is what was tried and did not fit.
@pytest.mark.parametrize("batch, fits, chosen, too_large", [(12, 5, 4, (12, 6)), (8, 8, 8, ()), (16, 1, 1, (16, 4, 2)),
                                                            (32, 10, 8, (32, 16)), (32, 20, 16, (32,))])
def test_auto_keeps_the_largest_divisor_whose_real_steps_fit(monkeypatch, batch, fits, chosen, too_large):
    lines = []
    fit = _search(("bf16", "fused"), batch, monkeypatch, fits, lines.append)
    assert (fit.micro_batch, fit.too_large) == (chosen, too_large) and fit.probe_s > 0
    # a line a try, in the order tried, each saying how it ended
    tried = [(int(ln.split("=")[1].split(":")[0]), ln.split(": ")[1].split(" (")[0]) for ln in lines]
    assert {m for m, outcome in tried if outcome == "out of memory"} == set(too_large)
    assert max(m for m, outcome in tried if outcome == "fits") == chosen and tried[0][0] == batch


def test_a_try_steps_two_micro_batches_whatever_the_batch(monkeypatch):
    # The second micro-batch reaches the peak of every later one; a step of all 16 would make a try 8 times longer.
    from Utils.model import GPT
    forward, rows = GPT.forward, []
    monkeypatch.setattr(GPT, "forward", lambda self, idx, targets=None: (rows.append(idx.shape[0]),
                                                                          forward(self, idx, targets))[1])
    cfg = parse_args(["--steps", "4", "--batch-size", "16", "--prefix", "p"] + ARGS)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    for micro, expected in ((2, [2, 2]), (8, [8, 8]), (16, [16])):
        rows.clear()
        _probe(("fused",), cfg, micro, CPU, tokens, distributed.from_env(""), None, {})
        assert rows == expected * PROBE_STEPS


def test_auto_says_when_not_even_one_row_fits(monkeypatch):
    with pytest.raises(NothingFits, match="not even MICRO_BATCH=1 fits"):
        _search(("fused",), 4, monkeypatch, 0)


def test_out_of_memory_inside_torch_compile_is_taken_for_one(monkeypatch):
    # Inductor runs what it compiles: an OOM there arrives wrapped (BackendCompilerFailed, its cause the OOM).
    from torch._dynamo.exc import BackendCompilerFailed
    from Utils.model import GPT
    forward = GPT.forward

    def wrapped(self, idx, targets=None):
        if idx.shape[0] > 2:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
            except torch.OutOfMemoryError as oom:
                raise BackendCompilerFailed(lambda *a: None, oom, None) from oom
        return forward(self, idx, targets)
    monkeypatch.setattr(GPT, "forward", wrapped)
    cfg = parse_args(["--steps", "4", "--batch-size", "8", "--prefix", "p"] + ARGS)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    fit = search(8, lambda m: _probe(("fused",), cfg, m, CPU, tokens, distributed.from_env(""), None, {}),
                 out_of_memory, CPU)
    assert (fit.micro_batch, fit.too_large) == (2, (8, 4))
    assert not out_of_memory(RuntimeError("a kernel failed"))


def test_an_error_that_is_not_out_of_memory_is_not_taken_for_one(monkeypatch):
    from Utils.model import GPT

    def broken(self, idx, targets=None):
        raise RuntimeError("a kernel failed")
    monkeypatch.setattr(GPT, "forward", broken)
    cfg = parse_args(["--steps", "4", "--batch-size", "4", "--prefix", "p"] + ARGS)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        search(4, lambda m: _probe(("fused",), cfg, m, CPU, tokens, distributed.from_env(""), None, {}),
               out_of_memory, CPU)


def test_cold_caches_renewed_after_the_search_leave_the_run_an_empty_folder_and_remove_every_one(monkeypatch):
    import os

    from Utils.train.compile_caches import cold_caches
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/kept")
    with cold_caches(True) as renew:
        first = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        open(os.path.join(first, "compiled-by-the-search"), "w").close()
        renew()
        second = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert second != first and os.listdir(second) == []
        assert os.environ["TRITON_CACHE_DIR"] == os.path.join(second, "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/kept"
    assert not os.path.exists(first) and not os.path.exists(second)
    with cold_caches(False) as renew:
        renew()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/kept"


def test_each_micro_batch_but_the_last_skips_the_gradient_reduction(monkeypatch):
    cfg = _config(micro_batch=1)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    b = build(("fused",), CPU, PRESETS[cfg.model], cfg.seed, TokenLoader(tokens, 4, cfg.seq_len))
    syncs = []
    real = b.gradient_sync
    monkeypatch.setattr(b, "gradient_sync", lambda sync: (syncs.append(sync), real(sync))[1])
    make_step(b, cfg, StepClock(CPU))()
    assert syncs == [False, False, False, True]


@pytest.mark.parametrize("parallel, calls", [("ddp", ["no_sync"]), ("fsdp", [("set", False)]), ("", [])])
def test_gradient_sync_holds_back_ddp_and_fsdp_reductions_until_the_last_micro_batch(parallel, calls):
    import contextlib

    from Utils.ladder.parallel import gradient_sync

    class Module:
        def __init__(self):
            self.calls = []

        @contextlib.contextmanager
        def no_sync(self):
            self.calls.append("no_sync")
            yield

        def set_requires_gradient_sync(self, sync):
            self.calls.append(("set", sync))

    m = Module()
    with gradient_sync(m, parallel, sync=False):
        pass
    assert m.calls == calls
    m.calls.clear()
    with gradient_sync(m, parallel, sync=True):
        pass
    assert m.calls == ([("set", True)] if parallel == "fsdp" else [])


def test_with_cuda_graphs_the_gradients_of_several_micro_batches_live_outside_the_graphs(monkeypatch):
    # A CUDA graph's replay overwrites the memory of its outputs: a gradient must not be one of them.
    from Utils.ladder.apply import Build
    monkeypatch.setattr(Build, "cudagraphs", property(lambda self: True))
    cfg = _config(micro_batch=2)
    tokens, _ = load_tokens("synthetic", PRESETS[cfg.model].vocab_size, cfg.seed, None)
    b = build(("fused",), CPU, PRESETS[cfg.model], cfg.seed, TokenLoader(tokens, 4, cfg.seq_len))
    step = make_step(b, cfg, StepClock(CPU))
    grads = {n: p.grad for n, p in b.model.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values())   # allocated before any graph runs
    step()
    assert all(p.grad is grads[n] and not p.grad.any() for n, p in b.model.named_parameters())   # zeroed in place


@pytest.mark.parametrize("error, oom", [
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("Triton Error [CUDA]: out of memory"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("CUDA error: out of memory"), False)])
def test_memory_outside_pytorchs_allocator_running_out_is_out_of_memory(error, oom):
    assert out_of_memory(error) is oom


def _hint(additions, seq_len, cap, fits_up_to, weights=0.5, states=1.0, **seen_too):
    """_nothing_fits for a run whose measured weights and optimizer states are given in GiB and whose one row fits
    up to `fits_up_to` tokens; returns (its message, the SEQ_LENs it tried)."""
    from dataclasses import replace

    from Utils.train.micro import _nothing_fits
    cfg = replace(parse_args(["--steps", "4", "--batch-size", "4", "--prefix", "p", "--model", "gpt2",
                              "--seq-len", str(seq_len), "--data", "synthetic"]), gpu_memory_gib=cap)
    tried = []

    def try_row(c):
        tried.append(c.seq_len)
        if c.seq_len > fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
    seen = {"weights": weights * 2**30, "after_step": (weights + states) * 2**30, **seen_too}
    return _nothing_fits(additions, cfg, CPU, seen, try_row, lambda line: None), tried


def test_when_one_row_does_not_fit_the_hint_names_a_sequence_length_it_tried_and_that_fits():
    message, tried = _hint(("tf32",), 1024, 3.5, fits_up_to=256)
    assert tried == [512, 256]
    assert message.startswith("out of memory at MICRO_BATCH=1: of 3.5 GiB, the weights (0.50 GiB), their gradients "
                              "and the optimizer's states take 2.00 GiB (measured) before any activation, leaving 1.50")
    assert message.endswith("one row at SEQ_LEN=256 fits (tried): run with SEQ_LEN=256")


def test_when_the_optimizer_leaves_no_room_the_hint_names_the_8bit_rung_then_a_smaller_model():
    # 2.0 of 2.2 GiB before any activation: no sequence length is tried; 8-bit states save 1.5 x the weights
    message, tried = _hint(("tf32",), 1024, 2.2, fits_up_to=1024)
    assert tried == [] and message.endswith("the 8bit rung's optimizer states take a quarter of AdamW's, 1.25 GiB in "
                                            "all: try it (make 8bit)")
    message, tried = _hint(("tf32", "8bit"), 1024, 1.0, fits_up_to=0, states=0.25)
    assert tried == [] and "MODEL=tiny (" in message and message.endswith("before any activation: try it")
    # no row fits at any tried length, and 8-bit states would leave room: both said
    message, tried = _hint(("tf32",), 256, 2.8, fits_up_to=0)
    assert tried == [128, 64] and "not even one row at SEQ_LEN=64 fits (tried)" in message and "make 8bit" in message


def _unloaded(additions):
    """The advice where gpt2 did not even load on a 1 GiB card: its weights counted, not measured."""
    from dataclasses import replace

    from Utils.train.micro import _nothing_fits
    cfg = replace(parse_args(["--steps", "4", "--batch-size", "4", "--prefix", "p", "--model", "gpt2",
                              "--data", "synthetic"]), gpu_memory_gib=1.0)
    return _nothing_fits(additions, cfg, CPU, {}, lambda c: None, lambda line: None)


def test_the_hint_counts_bf16_weights_with_fp32_masters_under_master_weights():
    # The same model as above with its weights in bf16 (0.25 GiB) and the fp32 master, m and v (1.5 GiB): 16 bytes
    # a parameter, as fp32 weights with AdamW's states; the 8bit rung would hold the same 1.25 GiB as from there.
    message, tried = _hint(("bf16", "master_weights"), 1024, 2.2, fits_up_to=1024, weights=0.25, states=1.5)
    assert "take 2.00 GiB (measured)" in message and message.endswith(
        "the 8bit rung's optimizer states take a quarter of AdamW's, 1.25 GiB in all: try it (make 8bit)")
    # Not loaded: 2 bytes a parameter counted, and 16 with the gradients and states.
    from Utils.train.micro import _parameters
    message = _unloaded(("bf16", "master_weights"))
    weights = 2 * _parameters("gpt2") / 2**30
    assert f"the weights ({weights:.2f} GiB)" in message and f"take {8 * weights:.2f} GiB (estimated" in message


def test_the_hint_counts_8_bytes_a_parameter_without_masters():
    """stochastic_rounding: bf16 weights, gradients, m and v, 8 bytes a parameter, half of master_weights' 16."""
    from Utils.train.micro import _parameters
    message = _unloaded(("bf16", "stochastic_rounding"))
    weights = 2 * _parameters("gpt2") / 2**30
    assert f"the weights ({weights:.2f} GiB)" in message and f"take {4 * weights:.2f} GiB (estimated" in message


@pytest.mark.parametrize("users, recorded", [("", "expandable_segments:True"),
                                             ("max_split_size_mb:64", "max_split_size_mb:64")])
def test_the_allocator_grows_its_segments_unless_the_user_set_it_and_the_run_records_which(tmp_path, monkeypatch,
                                                                                          users, recorded):
    import json
    import os
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users)   # restored after the test, whatever main sets
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert main("baseline", ["--steps", "2", "--batch-size", "2", "--prefix", str(tmp_path)] + ARGS) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == recorded
    (run,) = read_csv(tmp_path / "runs.csv")
    assert json.loads(run["config"])["run"]["allocator"] == recorded


def test_the_hint_counts_gradients_kept_between_steps_once_and_counts_weights_that_never_loaded():
    # Accumulating under CUDA graphs the gradients stay allocated: the memory after a step holds them already.
    message, _ = _hint(("tf32",), 1024, 3.5, fits_up_to=256, grads_kept=True, states=1.5)
    assert "take 2.00 GiB (measured)" in message
    # The model itself did not load: its fp32 weights counted (gpt2: 124.4M parameters x 4 bytes), AdamW's on top.
    from Utils.train.micro import _parameters
    message = _unloaded(("tf32",))
    weights = 4 * _parameters("gpt2") / 2**30
    assert f"the weights ({weights:.2f} GiB)" in message and f"take {4 * weights:.2f} GiB (estimated" in message
    assert "MODEL=tiny" in message


def test_a_run_that_auto_chose_and_still_runs_out_of_memory_starts_again_at_the_next_divisor(tmp_path, monkeypatch):
    # On a CPU auto takes the whole batch, 8 rows. A micro-batch of more than 2 rows runs out of memory from its
    # second forward on: the run at 8 records a step, runs out in its second, starts again at 4 (out at once), then
    # at 2, from the same weights and data, so it ends where a run given MICRO_BATCH=2 ends, with only its steps.
    from Utils.model import GPT
    given = tmp_path / "given"
    assert main("baseline", ["--steps", "3", "--batch-size", "8", "--prefix", str(given), "--micro-batch", "2"]
                + ARGS) == 0
    forward, large = GPT.forward, []

    def limited(self, idx, targets=None):
        if idx.shape[0] > 2:
            large.append(idx.shape[0])
            if len(large) > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return forward(self, idx, targets)
    monkeypatch.setattr(GPT, "forward", limited)
    auto = tmp_path / "auto"
    assert main("baseline", ["--steps", "3", "--batch-size", "8", "--prefix", str(auto)] + ARGS) == 0
    assert large == [8, 8, 4]
    (run,) = read_csv(auto / "runs.csv")
    assert (run["status"], run["micro_batch"], run["accumulation_steps"]) == ("ok", "2", "4")
    assert "MICRO_BATCH=auto chose 8; the run ran out of memory at 8, 4 and was measured at 2" in run["notes"]
    assert [r["step"] for r in read_csv(auto / "results.csv")] == ["0", "1", "2"]
    (reference,) = read_csv(given / "runs.csv")
    assert float(run["final_loss"]) == float(reference["final_loss"])


def test_a_run_starts_again_at_most_twice_and_then_ends_oom_saying_where_it_ran_out(tmp_path, monkeypatch):
    _fake_memory(monkeypatch, 1)
    assert main("baseline", ["--steps", "3", "--batch-size", "8", "--prefix", str(tmp_path)] + ARGS) == 3
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["status"] == "oom" and run["message"].startswith(
        "out of memory at MICRO_BATCH=2 (BATCH_SIZE=8) after 0 steps, the run having run out at 8, 4 before "
        "(MICRO_BATCH=auto chose 8): try MICRO_BATCH=1")


@pytest.mark.parametrize("auto, active, restarts, error, smaller", [
    (True, False, 0, torch.OutOfMemoryError("CUDA out of memory."), 4),
    (True, False, 2, torch.OutOfMemoryError("CUDA out of memory."), None),     # started again twice already
    (True, True, 0, torch.OutOfMemoryError("CUDA out of memory."), None),      # several processes: none alone
    (False, False, 0, torch.OutOfMemoryError("CUDA out of memory."), None),    # MICRO_BATCH given: kept
    (True, False, 0, RuntimeError("an illegal memory access was encountered"), None),
])
def test_only_a_single_process_run_auto_chose_starts_again_and_only_on_out_of_memory(auto, active, restarts, error,
                                                                                     smaller):
    from dataclasses import replace
    from types import SimpleNamespace
    from Utils.train.micro import smaller_micro_batch
    cfg = replace(_config(), batch_size=12, micro_batch=6)
    assert smaller_micro_batch(error, cfg, auto, SimpleNamespace(active=active), restarts) == smaller


def test_a_micro_batch_given_outright_that_runs_out_of_memory_ends_oom_naming_a_smaller_one(tmp_path, monkeypatch):
    _fake_memory(monkeypatch, 2)
    assert main("baseline", ["--steps", "3", "--batch-size", "8", "--prefix", str(tmp_path), "--micro-batch", "4"]
                + ARGS) == 3
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["status"] == "oom" and run["message"].startswith(
        "out of memory at MICRO_BATCH=4 (BATCH_SIZE=8) after 0 steps: try MICRO_BATCH=2, or MICRO_BATCH=auto")


def test_a_run_where_nothing_fits_records_its_memory_cap_so_the_report_shows_its_hint(tmp_path, monkeypatch):
    # Without GPU_MEMORY_GIB in its row, the report took such a run for one of another configuration and left
    # out its hint ("GPU_MEMORY_GIB (blank) != 3.5").
    import dataclasses
    import Utils.train.run as run_module

    def nothing_fits(*args):
        raise NothingFits("out of memory at MICRO_BATCH=1: run with SEQ_LEN=512")
    monkeypatch.setattr(run_module, "choose_micro_batch", nothing_fits)
    cfg = dataclasses.replace(parse_args(["--steps", "2", "--batch-size", "4", "--prefix", str(tmp_path)] + ARGS),
                              gpu_memory_gib=3.5)   # refused on a CPU by the command line, not by the run
    assert run_module.run((), cfg, "no_optimization.py") == 3
    (run,) = read_csv(tmp_path / "runs.csv")
    assert (run["status"], run["gpu_memory_gib"], run["message"]) == (
        "oom", "3.5", "out of memory at MICRO_BATCH=1: run with SEQ_LEN=512")
