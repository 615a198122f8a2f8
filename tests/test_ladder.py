"""The ladder on the CPU: the registry (Utils.ladder.registry), one apply function per addition and `build`
(Utils.ladder.apply), the modules they swap in (Utils.ladder.modules), and `python -m Utils.ladder`."""
import contextlib
import inspect
import itertools
import random
import re
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from conftest import REPO_ROOT, model_pair
from Utils.kernels import chunked_loss, cublaslt, fp8, fp8_linear, fp8_loss, loss_kernel, packed_attention
from Utils.ladder import apply, modules, registry
from Utils.ladder.apply import GRAD_CLIP, Build, Unavailable, build
from Utils.ladder.registry import (ABLATION, ADDITIONS, FUSED_ALONE, ablation_additions, additions_of, LADDER,
                                   LEAVE_ONE_OUT, MAX_ADDITIONS, RUNGS, STAGES, Addition, RegistryError, resolve,
                                   rung_order, run_name)
from Utils.model import GPT, MLP, CausalSelfAttention, OutputLoss
from Utils.model_config import PRESETS
from Utils.ladder.linear import LinearPlan

CPU = torch.device("cpu")
SMALL = replace(PRESETS["tiny"], vocab_size=97)   # the tiny model with a vocabulary that builds in milliseconds
WIDE = replace(SMALL, n_embd=1040, n_head=8)   # wide enough for fp8_dgrad's GEMMs to pay (layers_wider_than)
FLASH, FUSED = RUNGS["flash"].additions, RUNGS["fused"].additions


@pytest.fixture(autouse=True)
def keep_tf32_flags():
    """build() sets torch's process-wide TF32 flags: put them back for the tests that follow."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make(additions, config=SMALL, loader=None):
    return build(additions, CPU, config, seed=0, loader=loader)


def possible(names) -> bool:
    try:
        resolve(list(names))
    except RegistryError:
        return False
    return True


def requirements(name):
    """name and every addition it needs, transitively."""
    names, todo = set(), [name]
    while todo:
        n = todo.pop()
        names.add(n)
        todo.extend(ADDITIONS[n].requires)
    return names


# ================================================================================================ registry

def test_the_ladder_is_cumulative_one_change_per_rung():
    assert LADDER == ["baseline", "tf32", "bf16", "torch_compile", "flash", "fused", "8bit", "max"]
    assert RUNGS["baseline"].additions == ()
    for prev, rung in zip(LADDER[:5], LADDER[1:6]):
        before, after = RUNGS[prev].additions, RUNGS[rung].additions
        assert after[:len(before)] == before, rung              # everything the rung below has, and
        assert set(after) - set(before) == {rung}, rung         # one change, named as the rung
    # The 8bit rung swaps the optimizer of the flash rung, as the original study did.
    assert RUNGS["8bit"].additions == FLASH + ("8bit",)
    assert RUNGS["max"].additions == FUSED + MAX_ADDITIONS


def test_max_is_the_fused_rung_and_what_measured_faster_on_the_h200():
    assert set(MAX_ADDITIONS) == {"vocab_multiple", "fp8_head", "prefetch", "sync_every", "cudagraphs",
                                  "bf16_residual", "gelu_epilogue", "fold_clip", "packed_attention",
                                  "gemm_bias_grad", "fp8_qkv_fc", "fp8_dgrad", "combo_kernels", "fold_norm",
                                  "stochastic_rounding"}
    # Pinned: max's additions are a measured result (BENCHMARKS.md gives each one's gain); a new addition joins it
    # only by changing this set. What max leaves out is every other one, and needs no list here.
    assert set(MAX_ADDITIONS) < set(ABLATION)


def test_ablation_is_every_addition_beyond_the_seven_rungs_in_registry_order():
    in_rungs = {a for r in LADDER if r != "max" for a in RUNGS[r].additions}
    assert list(ABLATION) == [a for a in ADDITIONS if a not in in_rungs]


@pytest.mark.parametrize("name", FUSED_ALONE)
def test_every_ablation_addition_is_valid_on_the_fused_rung(name):
    assert set(resolve(FUSED + (name,))) == set(FUSED) | {name}
    assert run_name(FUSED + (name,)) == f"fused+{name}"


def test_the_fused_ablation_tries_alone_what_runs_alone_and_the_rest_with_what_they_build_on():
    assert [a for a in ABLATION if a not in FUSED_ALONE] == ["recompute_logits"]
    assert ablation_additions("fused", "fp8_head+recompute_logits") == resolve(FUSED + ("fp8_head", "recompute_logits"))
    with pytest.raises(RegistryError, match=r"recompute_logits needs fp8_head: try fp8_head\+recompute_logits"):
        ablation_additions("fused", "recompute_logits")


@pytest.mark.parametrize("rung", LADDER)
def test_every_rungs_additions_resolve(rung):
    additions = RUNGS[rung].additions
    assert len(set(additions)) == len(additions), "an addition named twice"
    assert set(resolve(additions)) == set(additions)


@pytest.mark.parametrize("names, message", [
    (("fold_clip",), r"fold_clip needs fused: add fused to WITH"),
    (("cudagraphs",), r"cudagraphs needs torch_compile: add torch_compile"),
    (("compiled_update",), r"compiled_update needs torch_compile: add torch_compile"),
    (("cudnn_attention",), r"cudnn_attention needs flash and bf16: add flash bf16 to WITH"),
    (("flash", "cudnn_attention"), r"cudnn_attention needs bf16: add bf16 to WITH"),
    (("tf32", "bf16_residual"), r"bf16_residual needs bf16: add bf16"),
    (("tf32", "gelu_epilogue", "packed_attention"), r"gelu_epilogue needs bf16: add bf16"),
    (("fused", "8bit"), r"fused cannot run with 8bit: keep one of fused, 8bit"),
    (FUSED + ("8bit",), r"fused cannot run with 8bit"),
    (("loss", "loss_kernel"), r"loss cannot run with loss_kernel: keep one of loss, loss_kernel"),
    (RUNGS["max"].additions + ("loss",), r"fp8_head cannot run with loss: keep one of fp8_head, loss"),
    (("torch_compile", "fused", "fold_clip", "compiled_update"),
     r"fold_clip cannot run with compiled_update: keep one of fold_clip, compiled_update"),
    (("bf16", "fp8", "gemm_bias_grad"), r"gemm_bias_grad cannot run with fp8"),
    (("bf16", "fp8", "gelu_epilogue"), r"gelu_epilogue cannot run with fp8"),
    (("bf16", "flash", "cudnn_attention", "packed_attention"), r"cudnn_attention cannot run with packed_attention"),
    (("fused", "nonsense"), r"unknown addition nonsense: use names from `make additions` \(tf32, bf16, "),
    (("flsh", "fused", "lose"), r"unknown additions flsh, lose: "),
])
def test_impossible_combinations_are_refused_in_one_line_naming_the_fix(names, message):
    with pytest.raises(RegistryError, match=message) as e:
        resolve(names)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)   # callers that catch ValueError catch it too
    with pytest.raises(RegistryError):
        run_name(names)


def test_resolve_puts_additions_in_the_registry_order_and_ignores_repeats():
    shuffled = list(RUNGS["max"].additions) * 2
    random.Random(0).shuffle(shuffled)
    assert resolve(shuffled) == tuple(a for a in ADDITIONS if a in RUNGS["max"].additions)
    assert resolve(["fused", "tf32", "fused"]) == ("tf32", "fused")
    assert resolve([]) == ()


def test_registry_entries_are_consistent():
    assert len(registry._ADDITIONS) == len(ADDITIONS), "two additions with one name"
    order = list(ADDITIONS)
    for name, a in ADDITIONS.items():
        assert a.name == name and a.stage in STAGES and a.changes, name
        assert set(a.requires) <= set(ADDITIONS) and set(a.excludes) <= set(ADDITIONS), name
        assert not set(a.requires) & set(a.excludes), name
        for r in a.requires:
            # build applies in registry order: what an addition builds on must have been applied before it.
            assert STAGES.index(ADDITIONS[r].stage) <= STAGES.index(a.stage), (name, r)
            assert order.index(r) < order.index(name), (name, r)
            assert name not in ADDITIONS[r].excludes, (name, r)
    for name, rung in RUNGS.items():
        assert rung.name == name and set(rung.additions) <= set(ADDITIONS), name
    assert len({r.script for r in RUNGS.values()}) == len(RUNGS)
    with pytest.raises(ValueError, match="stage must be one of"):
        Addition("x", "runtime", "compute", "a stage that build() never applies")
    with pytest.raises(ValueError, match="pillar one of"):
        Addition("x", "model", "latency", "a pillar that the breakdown does not know")


@pytest.mark.parametrize("name", ADDITIONS)
def test_every_addition_has_the_text_its_readers_show(name):
    # The notebook gives a rung named after an addition that addition's own section, and the max rung's section
    # lists every addition beyond the seven rungs and why each one max takes can help (Utils.report.notebook_prose).
    a = ADDITIONS[name]
    assert a.changes and a.pillar and a.stage
    assert bool(a.title) == bool(a.notebook) == (name in RUNGS)
    assert all(p and p == p.strip() for p in a.notebook)
    assert bool(a.phrase) == (name in ABLATION)
    assert not a.phrase or f"`{name}`" in a.phrase, "the max rung's list names each addition in backticks"
    assert not a.in_max or a.why
    assert not a.why or (name in ABLATION and not a.why.endswith(".")), "a clause of the max rung's reasons"


@pytest.mark.parametrize("rung", LADDER)
def test_run_name_of_a_rungs_own_additions_is_the_rungs_name(rung):
    additions = list(RUNGS[rung].additions)
    assert run_name(additions) == rung
    random.Random(1).shuffle(additions)
    assert run_name(additions) == rung


def test_run_name_is_the_largest_rung_contained_plus_the_rest_in_registry_order():
    assert run_name(FUSED + ("loss",)) == "fused+loss"
    assert run_name(("prefetch", "loss") + FUSED) == "fused+loss+prefetch"
    assert run_name(FLASH + ("8bit", "bf16_residual")) == "8bit+bf16_residual"
    assert run_name(("tf32", "bf16", "flash")) == "bf16+flash"
    assert run_name(("tf32", "vocab_multiple")) == "tf32+vocab_multiple"


@pytest.mark.parametrize("name", LEAVE_ONE_OUT)
def test_max_without_one_addition_is_named_max_minus_it_and_gives_back_its_additions(name):
    without = [a for a in RUNGS["max"].additions if a != name]
    assert run_name(without) == f"max-{name}"
    assert set(additions_of(f"max-{name}")) == set(without)


def test_max_without_several_additions_is_named_max_minus_each_in_registry_order_and_gives_back_its_additions():
    for a, b in itertools.combinations(LEAVE_ONE_OUT, 2):
        without = ablation_additions("max", f"{b}+{a}")   # named in either order: one run name
        assert set(RUNGS["max"].additions) - set(without) == {a, b}
        assert run_name(without) == f"max-{a}-{b}"
        assert set(additions_of(f"max-{a}-{b}")) == set(without)
    assert additions_of("max-prefetch-prefetch") is None and additions_of("max-prefetch-loss") is None


def test_additions_tried_together_on_the_fused_rung_are_named_fused_plus_each():
    assert run_name(ablation_additions("fused", "prefetch+loss")) == "fused+loss+prefetch"
    assert set(additions_of("fused+loss+prefetch")) == set(FUSED) | {"loss", "prefetch"}


@pytest.mark.parametrize("base, item, message", [
    ("max", "loss", "make ablation FROM=max does not try 'loss': use some of vocab_multiple,"),
    ("fused", "prefetch+", "'prefetch+' has an empty name between '+' signs: remove the extra '+'"),
    ("fused", "prefetch+warp", "make ablation FROM=fused does not try 'warp': use some of"),
    ("max", "prefetch+prefetch", "'prefetch+prefetch' names an addition twice: name each once"),
    ("fused", "loss+fp8_head", "fp8_head cannot run with loss: keep one of fp8_head, loss"),
    ("flash", "loss", "FROM='flash': use FROM=fused"),
    ("max", "prefetch++sync_every", "'prefetch++sync_every' has an empty name between '+' signs"),
    ("max", "+".join(LEAVE_ONE_OUT[:8]), f"'{'+'.join(LEAVE_ONE_OUT[:8])}' names so many additions that the run "
                                         "would be recorded as fused+"),
])
def test_an_ablation_item_that_cannot_run_is_refused_naming_the_fix(base, item, message):
    with pytest.raises(RegistryError) as e:
        ablation_additions(base, item)
    assert str(e.value).startswith(message)


def test_leave_one_out_is_every_addition_max_has_beyond_the_fused_rung():
    assert set(LEAVE_ONE_OUT) == set(RUNGS["max"].additions) - set(RUNGS["fused"].additions) == set(MAX_ADDITIONS)
    assert list(LEAVE_ONE_OUT) == [a for a in ADDITIONS if a in LEAVE_ONE_OUT]   # in the order they apply


def test_a_name_with_two_parts_keeps_the_plus_form_and_an_unknown_minus_gives_nothing():
    assert run_name(FLASH + ("8bit",)) == "8bit" and run_name(FUSED + ("loss",)) == "fused+loss"
    assert run_name([a for a in FUSED if a != "tf32"]) == "fused-tf32"   # four '+' parts against one '-'
    assert additions_of("max-warp_drive") is None and additions_of("turbo-prefetch") is None
    assert additions_of("fused-loss") is None   # fused has no loss to leave out
    assert additions_of("peer-hf") is None


def test_run_names_tell_different_additions_apart():
    # A run is recorded, charted and compared under its name: two different sets of additions under one
    # name would be mixed up as one rung.
    combinations = [r.additions for r in RUNGS.values()]
    combinations += [FUSED + (a,) for a in FUSED_ALONE]
    combinations += [tuple(a for a in RUNGS["max"].additions if a != x) for x in RUNGS["max"].additions
                     if possible(a for a in RUNGS["max"].additions if a != x)]
    combinations += [FLASH + (a,) for a in FUSED_ALONE if a != "fold_clip"]
    combinations += [tuple(requirements(a)) for a in ADDITIONS]   # each addition alone, with what it needs
    combinations += [tuple(a for i, a in enumerate(FLASH) if mask >> i & 1) for mask in range(2 ** len(FLASH))]
    seen, clashes = {}, set()
    for names in combinations:
        name, chosen = run_name(names), frozenset(resolve(names))
        if seen.setdefault(name, chosen) != chosen:
            clashes.add(f"{name}: {sorted(seen[name])} and {sorted(chosen)}")
    assert not clashes, "; ".join(sorted(clashes))


def test_rung_order_puts_rungs_in_ladder_order_then_the_rest_alphabetically():
    names = ["fused+loss", "max", "custom", "baseline", "flash", "bf16+flash", "max"]
    assert rung_order(names) == ["baseline", "flash", "max", "bf16+flash", "custom", "fused+loss"]


def test_every_addition_has_one_apply_function_and_every_apply_function_an_addition():
    assert list(apply.APPLY) == list(ADDITIONS)   # registered in the registry's order, one for each addition
    functions = {name for name, value in vars(apply).items() if name.startswith("apply_") and callable(value)}
    assert functions == {f"apply_{a}" for a in ADDITIONS}
    for name, function in apply.APPLY.items():
        # The notebook finds each one's source by this name (walkthrough.apply_sources).
        assert function.__name__ == f"apply_{name}" and getattr(apply, function.__name__) is function, name
        assert list(inspect.signature(function).parameters) == ["b"], name
        assert function.__doc__, f"{name} says what it changes and why"


def test_an_addition_registers_one_apply_function_and_only_an_addition_of_the_registry():
    with pytest.raises(ValueError, match="apply_tf32 is already its apply function"):
        apply.applies("tf32")(lambda b: None)
    with pytest.raises(ValueError, match="has no addition warp_drive"):
        apply.applies("warp_drive")(lambda b: None)
    assert apply.APPLY["tf32"] is apply.apply_tf32 and "warp_drive" not in apply.APPLY


# =================================================================================== python -m Utils.ladder

def ladder_cli(*args):
    return subprocess.run([sys.executable, "-m", "Utils.ladder", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def first_rung(name):
    """The first rung of the ladder that has the addition, '-' for those that only ablation and custom runs run."""
    return next((r.name for r in RUNGS.values() if name in r.additions), "-")


def test_cli_table_lists_every_addition_with_its_pillar_stage_change_needs_and_first_rung():
    proc = ladder_cli("table")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["addition", "pillar", "stage"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(ADDITIONS)
    for line, a in zip(lines[2:], ADDITIONS.values()):
        assert line.split()[:3] == [a.name, a.pillar, a.stage], line
        assert a.changes in line and a.needs in line and all(f"+{r}" in line for r in a.requires), line
        assert line.split()[-1] == first_rung(a.name), line


def test_cli_markdown_is_the_same_table_in_markdown():
    proc = ladder_cli("markdown")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + len(ADDITIONS) and lines[1].startswith("|---|")
    for line, a in zip(lines[2:], ADDITIONS.values()):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [f"`{a.name}`", a.pillar, a.stage, a.changes], line
        assert cells[-1].strip("`") == first_rung(a.name), line


def test_cli_rungs_pairs_each_rung_with_its_script_which_names_its_entry():
    proc = ladder_cli("rungs")
    assert proc.returncode == 0, proc.stderr
    pairs = [p.split(":") for p in proc.stdout.split()]
    assert pairs == [[r.name, r.script] for r in RUNGS.values()]
    for name, script in pairs:
        with open(f"{REPO_ROOT}/{script}") as f:
            # A few lines that name the registry entry, e.g. main("8bit"): no loop of its own.
            assert re.search(rf"""\(\s*["']{re.escape(name)}["']\s*\)""", f.read()), script


def test_cli_ablation_lists_the_ablation():
    proc = ladder_cli("ablation")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == list(FUSED_ALONE)
    proc = ladder_cli("ablation", "max")
    assert proc.returncode == 0 and proc.stdout.split() == list(LEAVE_ONE_OUT), proc.stderr
    assert ladder_cli("ablation", "flash").returncode == 2


@pytest.mark.parametrize("names, printed", [
    (FUSED + ("loss",), "fused+loss"),
    (tuple(reversed(RUNGS["max"].additions)), "max"),
    ((), "baseline"),
])
def test_cli_check_prints_the_run_name_of_a_possible_combination(names, printed):
    proc = ladder_cli("check", *names)
    assert proc.returncode == 0 and proc.stdout == printed + "\n" and not proc.stderr, proc


@pytest.mark.parametrize("names, fix", [
    (("fused", "8bit"), "keep one of fused, 8bit"),
    (("cudagraphs",), "add torch_compile to WITH"),
    (("fused", "nonsense"), "unknown addition nonsense"),
])
def test_cli_check_exits_2_with_one_line_for_an_impossible_combination(names, fix):
    proc = ladder_cli("check", *names)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and fix in proc.stderr, proc.stderr


@pytest.mark.parametrize("args,problem", [
    (("ladder",), "unknown command 'ladder': use one of table, markdown, rungs, ablation, check, check-ablation"),
    (("ablation", "fast"), "ablation takes nothing, fused or max, not 'fast'"),
    (("check-ablation",), "check-ablation needs FROM (fused or max), then the items to check"),
])
def test_cli_refuses_a_command_it_does_not_take_in_one_line(args, problem):
    proc = ladder_cli(*args)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.splitlines() == [f"error: python -m Utils.ladder {' '.join(args)}: {problem} "
                                        f"(python -m Utils.ladder --help)"]


def test_cli_help_prints_its_usage():
    proc = ladder_cli("--help")
    assert proc.returncode == 0 and "python -m Utils.ladder check NAMES" in proc.stdout


def test_the_registry_and_its_cli_load_no_torch():
    # `make help` and `make plots` read the registry where torch may not even be installed.
    code = "import sys, Utils.ladder.__main__ as m; m.main(['table']); print('torch' in sys.modules, file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip() == "False", proc.stderr


# ======================================================================================== build, on a CPU

def test_build_applies_the_stages_in_order(monkeypatch):
    seen = []
    for name in ADDITIONS:
        real = apply.APPLY[name]

        def spy(b, _name=name, _real=real):
            # What exists when each addition applies: model, step model, optimizer and update, batch source.
            seen.append((_name, b.model is not None, b.step_model is not None, b.optimizer is not None,
                         b.source is not None))
            return _real(b)
        monkeypatch.setitem(apply.APPLY, name, spy)
    loader = object()
    b = make(RUNGS["max"].additions, loader=loader)
    stage_of = {a: STAGES.index(ADDITIONS[a].stage) for a in ADDITIONS}
    expected = sorted(resolve(RUNGS["max"].additions), key=stage_of.get)   # stable: registry order within a stage
    assert [s[0] for s in seen] == expected
    built_before = {"settings": (False, False, False, False), "model": (True, False, False, False),
                    "compile": (True, True, False, False), "optimizer": (True, True, True, False),
                    "loop": (True, True, True, True)}
    for name, *state in seen:
        assert tuple(state) == built_before[ADDITIONS[name].stage], name
    assert b.additions == resolve(RUNGS["max"].additions) and b.source is loader


def test_torch_compile_wraps_the_model_after_its_modules_are_swapped():
    b = make(("torch_compile", "loss", "gemm_bias_grad"))
    assert isinstance(b.step_model, torch._dynamo.eval_frame.OptimizedModule)
    assert b.step_model._orig_mod is b.model
    compiled = b.step_model._orig_mod
    assert compiled.transformer.h[0].attn.c_attn.plan == LinearPlan(bias_grad=True)
    assert isinstance(compiled.loss, modules.ChunkedLoss)
    # The optimizer, built after the swaps, steps exactly the model's parameters.
    stepped = [p for group in b.optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, stepped)) == sorted(map(id, b.model.parameters()))


def compiled_on_a_gpu(*names):
    """The step model's Inductor configuration and the build after the compile additions `names`, applied in
    registry order as on a GPU: compilation is lazy, so nothing touches CUDA."""
    module = nn.Linear(4, 4)
    b = Build(device=torch.device("cuda"), config=SMALL, module=module, step_model=module)
    for name in resolve(names):
        apply.APPLY[name](b)
    assert b.step_model._orig_mod is module   # one wrapper around the module, not a wrapper of a wrapper
    return b.step_model.get_compiler_config(), b


@pytest.mark.parametrize("names, mode", [((), "default"), (("cudagraphs",), "reduce-overhead"),
                                         (("autotune",), "max-autotune-no-cudagraphs"),
                                         (("cudagraphs", "autotune"), "max-autotune")])
def test_the_compile_additions_compile_as_torch_compiles_modes(monkeypatch, names, mode):
    # The additions compile with options; each set must be exactly the mode's, so that the rungs measured with
    # modes compile as they did.
    monkeypatch.setattr(apply, "require_compiler", lambda device: None)
    config, b = compiled_on_a_gpu("torch_compile", *names)
    assert config == torch.compile(nn.Linear(4, 4), mode=mode).get_compiler_config()
    assert b.cudagraphs == ("cudagraphs" in names)


def test_combo_kernels_adds_its_option_to_the_other_compile_additions(monkeypatch):
    monkeypatch.setattr(apply, "require_compiler", lambda device: None)
    config, b = compiled_on_a_gpu("torch_compile", "cudagraphs", "combo_kernels")
    assert config["combo_kernels"] and config["triton.cudagraphs"] and b.cudagraphs
    assert b.compile_options == {"triton.cudagraphs": True, "combo_kernels": True,
                                 "combo_kernel_per_subkernel_blocks": True}
    assert config["combo_kernel_per_subkernel_blocks"]
    assert not compiled_on_a_gpu("torch_compile", "cudagraphs")[0]["combo_kernels"]


def test_combo_kernels_share_one_block_shape_where_inductor_has_no_other(monkeypatch):
    # An older PyTorch without the option still compiles: the option is left out, not passed unknown.
    monkeypatch.setattr(apply, "require_compiler", lambda device: None)
    monkeypatch.setattr(apply, "inductor_has", lambda option: False)
    _, b = compiled_on_a_gpu("torch_compile")
    note = apply.apply_combo_kernels(b)   # the run's record says so
    assert note.startswith("this PyTorch's Inductor has no combo_kernel_per_subkernel_blocks")
    config = b.step_model.get_compiler_config()
    assert b.compile_options == {"combo_kernels": True}
    assert config["combo_kernels"] and not config["combo_kernel_per_subkernel_blocks"]


def test_every_rung_starts_from_the_same_weights():
    # The seed is the only source of the initial weights: swaps, settings and padding draw nothing. A rung that
    # stores parameters in bf16 (max, through stochastic_rounding) holds the same weights rounded.
    plain = make(()).model.state_dict()
    for rung in ("flash", "max"):
        state = make(RUNGS[rung].additions).model.state_dict()
        assert state.keys() == plain.keys(), rung
        for key, value in plain.items():
            assert torch.equal(state[key][:value.shape[0]], value.to(state[key].dtype)), (rung, key)
    assert make(RUNGS["max"].additions).model.transformer.wte.weight.dtype == torch.bfloat16


def test_build_turns_tf32_off_unless_it_is_asked_for():
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    make(("bf16",))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    make(("tf32",))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


# What each addition does to a build on a CPU, against a build of only what it needs: (the note it leaves
# there, a regular expression, or None where it takes effect; a check of its effect).

def _tf32(b, base):
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def _bf16(b, base):
    assert base.autocast_dtype is None and b.autocast_dtype == torch.bfloat16
    with base.autocast():
        assert not torch.is_autocast_enabled("cpu")
    with b.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def _flash(b, base):
    assert b.config.flash and not base.config.flash
    assert all(block.attn.flash for block in b.model.transformer.h)
    assert not any(name.endswith("mask") for name, _ in b.model.named_buffers())


def _vocab_multiple(b, base):
    assert b.config.vocab_multiple == apply.VOCAB_MULTIPLE == 128 and base.config.vocab_multiple == 1
    assert b.model.transformer.wte.weight.shape[0] == b.config.padded_vocab_size == 128
    assert b.model.num_params() == base.model.num_params()
    # GPT-2's 50,257 rows become 50,304 = 393 x 128.
    assert replace(PRESETS["gpt2"], vocab_multiple=apply.VOCAB_MULTIPLE).padded_vocab_size == 50304


def _bf16_residual(b, base):
    assert len(b.model.transformer.h[0]._forward_pre_hooks) == 1 + len(base.model.transformer.h[0]._forward_pre_hooks)


def _gemm_bias_grad(b, base):
    for block in b.model.transformer.h:
        assert type(block.attn.c_attn) is type(block.mlp.c_fc) is modules.PlannedLinear
        assert block.attn.c_attn.plan == block.mlp.c_fc.plan == LinearPlan(bias_grad=True)
        assert type(block.attn.c_proj) is type(block.mlp.c_proj) is nn.Linear


def _fold_norm(b, base):
    for block, plain in zip(b.model.transformer.h, base.model.transformer.h):
        assert type(block.ln_1) is type(block.ln_2) is modules.NormalizeOnly and type(plain.ln_1) is nn.LayerNorm
        assert block.attn.c_attn.plan.fold and block.mlp.c_fc.plan.fold
        assert block.attn.c_attn.norm is block.ln_1 and block.mlp.c_fc.norm is block.ln_2


def _plain_mlp(b, base):
    assert all(type(block.mlp) is MLP for block in b.model.transformer.h)


def _bf16_layers(b, base):
    for block in b.model.transformer.h:
        assert type(block.attn.c_attn) is type(block.mlp.c_fc) is nn.Linear


def _plain_sdpa(b, base):
    assert all(type(block.attn) is CausalSelfAttention and block.attn.flash for block in b.model.transformer.h)


def _chunked_loss(b, base):
    assert type(base.model.loss) is OutputLoss
    assert type(b.model.loss) is modules.ChunkedLoss and not b.model.loss.kernel


def _torch_compile(b, base):
    assert base.step_model is base.model and b.step_model._orig_mod is b.model and not b.cudagraphs


def _compiled_as_torch_compile(b, base):
    # torch_compile's wrapper, left as it was (no CUDA graphs, no other option), and the build says so.
    assert b.step_model._orig_mod is b.model and not b.cudagraphs and b.compile_options == {}


def _fused(b, base):
    assert not base.optimizer.defaults["fused"] and b.optimizer.defaults["fused"]
    assert type(b.optimizer) is torch.optim.AdamW


def _8bit(b, base):
    assert type(b.optimizer).__name__ == "AdamW8bit"


def _fold_clip(b, base):
    idx = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    b.model(idx, idx)[1].mul(100).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in b.model.parameters()])
    b.update()
    # fused AdamW divides each gradient by grad_scale as it reads it: the inverse of the clip's factor.
    assert norm > GRAD_CLIP and b.optimizer.grad_scale.item() == pytest.approx(norm.item() / GRAD_CLIP, rel=1e-5)


def _master_weights(b, base):
    norms = {id(p) for m in b.model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    assert norms and all((p.dtype == torch.float32) == (id(p) in norms) for p in b.model.parameters())
    assert all(p.dtype == torch.float32 for p in base.model.parameters())
    assert b.model.lm_head.weight is b.model.transformer.wte.weight   # still tied
    assert type(b.optimizer).__name__ == "MasterAdamW" and type(base.optimizer) is torch.optim.AdamW
    idx = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with b.autocast():   # the embeddings' sum stays fp32, as with fp32 weights: the residual is bf16_residual's
        assert b.model.transformer.wte(idx).dtype == torch.float32
        loss = b.model(idx, idx)[1]
    loss.backward()
    assert all(p.grad.dtype == p.dtype for p in b.model.parameters())
    weight = b.model.transformer.h[0].attn.c_attn.weight
    before = weight.detach().clone()
    b.update()
    master = b.optimizer.state[weight]["master"]
    assert master.dtype == torch.float32 and torch.equal(weight.detach(), master.to(torch.bfloat16))
    assert not torch.equal(weight.detach(), before)


def _stochastic_rounding(b, base):
    weight = b.model.transformer.h[0].attn.c_attn.weight
    assert weight.dtype == torch.bfloat16 and type(b.optimizer).__name__ == "MasterAdamW" and not b.optimizer.masters
    idx = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with b.autocast():
        loss = b.model(idx, idx)[1]
    loss.backward()
    before = weight.detach().clone()
    b.update()
    state = b.optimizer.state[weight]
    assert "master" not in state and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert not torch.equal(weight.detach(), before)


def _logits_stored(b, base):
    assert type(b.model.loss) is type(base.model.loss) and not getattr(b.model.loss, "recompute", False)


def _compiled_update(b, base):
    assert hasattr(b.update, "_torchdynamo_orig_callable") and not hasattr(base.update, "_torchdynamo_orig_callable")


def _prefetch(b, base):
    assert b.source is base.source


def _sync_every(b, base):
    assert base.sync_every == 1 and b.sync_every == apply.SYNC_EVERY == 10


CPU_EFFECTS = {
    "tf32": (r"TF32 has no effect on a CPU", _tf32),
    "bf16": (None, _bf16),
    "flash": (None, _flash),
    "vocab_multiple": (None, _vocab_multiple),
    "bf16_residual": (None, _bf16_residual),
    "gemm_bias_grad": (None, _gemm_bias_grad),
    "gelu_epilogue": (r".+: the plain MLP instead", _plain_mlp),
    "cudnn_attention": (r".+: plain SDPA instead", _plain_sdpa),
    "packed_attention": (r".+: plain SDPA instead", _plain_sdpa),
    "loss": (None, _chunked_loss),
    "loss_kernel": (r".+: the plain chunked loss instead", _chunked_loss),
    # On a CPU FP8 is only emulated, and the loss kernel needs a GPU: the plain chunked loss, and both reasons.
    "fp8_head": (r"FP8 matmuls are fast on an Ada or Hopper GPU only .+: the output layer in bf16 instead; "
                 r"the loss kernel needs .+: the plain chunked loss instead", _chunked_loss),
    "recompute_logits": (r"recomputing the logits needs a Hopper GPU .+: its logits stored and read back",
                         _logits_stored),
    "fp8_qkv_fc": (r"FP8 GEMMs need an Ada or Hopper GPU .+: c_attn and c_fc in bf16 instead", _bf16_layers),
    "fp8_dgrad": (r"FP8 GEMMs need an Ada or Hopper GPU .+: c_attn's and c_fc's input gradients in bf16 instead",
                  _bf16_layers),
    "fp8": (None, None),   # refused on a CPU: test_fp8_is_refused_where_it_cannot_run
    "fold_norm": (None, _fold_norm),
    "master_weights": (None, _master_weights),
    "torch_compile": (None, _torch_compile),
    "cudagraphs": (r"CUDA graphs need a GPU: compiled in the default mode", _compiled_as_torch_compile),
    "autotune": (r"max-autotune tunes GPU GEMMs: compiled in the default mode", _compiled_as_torch_compile),
    "combo_kernels": (r"combo kernels group Triton kernels on a GPU: compiled without them", _compiled_as_torch_compile),
    "fused": (None, _fused),
    "8bit": (None, _8bit),
    "fold_clip": (None, _fold_clip),
    "stochastic_rounding": (None, _stochastic_rounding),
    "compiled_update": (None, _compiled_update),
    "prefetch": (r"prefetch has no effect on a CPU", _prefetch),
    "sync_every": (r"deferred synchronization has no effect on a CPU.*", _sync_every),
}


def test_every_addition_has_its_cpu_effect_listed():
    assert set(CPU_EFFECTS) == set(ADDITIONS)


@pytest.mark.parametrize("name", [a for a in ADDITIONS if a != "fp8"])
def test_each_addition_on_a_cpu_takes_effect_or_says_what_runs_instead(name):
    note, check = CPU_EFFECTS[name]
    loader = object()
    base = make(requirements(name) - {name}, loader=loader)
    b = make(requirements(name), loader=loader)
    added = [n for n in b.notes if n not in base.notes]
    if note is None:
        assert added == []
    else:
        assert len(added) == 1 and re.fullmatch(note, added[0]) and "\n" not in added[0], added
    check(b, base)


# Where the kernels would run: the availability checks of Utils.kernels answer yes, so that each apply
# function swaps in what it swaps on a GPU (nothing is run here).

@pytest.fixture
def kernels_available(monkeypatch):
    prepared = []
    monkeypatch.setattr(cublaslt, "unavailable", lambda device: None)
    monkeypatch.setattr(cublaslt, "prepare", lambda device: prepared.append(("cublaslt", device)))
    monkeypatch.setattr(packed_attention, "cudnn_unavailable", lambda device: None)
    monkeypatch.setattr(packed_attention, "unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(packed_attention, "prepare",
                        lambda device, head_dim: prepared.append(("packed_attention", head_dim)))
    monkeypatch.setattr(loss_kernel, "unavailable", lambda device: None)
    monkeypatch.setattr(loss_kernel, "prepare", lambda device, n_cols: prepared.append(("loss_kernel", n_cols)))
    return prepared


def test_where_cublaslt_runs_the_mlp_is_the_epilogue_mlp(kernels_available):
    b = make(("bf16", "gemm_bias_grad", "gelu_epilogue"))
    assert b.notes == [] and kernels_available == [("cublaslt", CPU)]
    for block in b.model.transformer.h:
        # c_fc keeps the feature gemm_bias_grad gave it first: its bias gradient from the GEMM.
        assert type(block.mlp) is modules.EpilogueMLP and block.mlp.c_fc.plan == LinearPlan(bias_grad=True)


def test_where_cudnn_has_fused_attention_cudnn_attention_holds_sdpa_to_it(kernels_available):
    b = make(("bf16", "flash", "cudnn_attention"))
    assert b.notes == [] and all(type(block.attn) is modules.CudnnAttention for block in b.model.transformer.h)


def test_packed_attention_falls_back_to_sdpa_held_to_cudnn_then_to_plain_sdpa(kernels_available, monkeypatch):
    b = make(("bf16", "packed_attention"))
    head_dim = SMALL.n_embd // SMALL.n_head
    assert b.notes == [] and kernels_available == [("packed_attention", head_dim)]
    assert all(type(block.attn) is modules.PackedAttention for block in b.model.transformer.h)

    monkeypatch.setattr(packed_attention, "unavailable", lambda device, head_dim: "no cuDNN frontend")
    b = make(("bf16", "packed_attention"))
    assert b.notes == ["no cuDNN frontend: SDPA held to cuDNN instead"]
    assert all(type(block.attn) is modules.CudnnAttention for block in b.model.transformer.h)

    # prepare() finds that cuDNN cannot run the packed graphs after all: its note, and the fallback.
    monkeypatch.setattr(packed_attention, "unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(packed_attention, "prepare", lambda device, head_dim: "cuDNN too old")
    monkeypatch.setattr(packed_attention, "cudnn_unavailable", lambda device: "no cuDNN attention")
    b = make(("bf16", "packed_attention"))
    assert b.notes == ["cuDNN too old: plain SDPA instead"]
    _plain_sdpa(b, None)


@pytest.mark.parametrize("vocab_multiple", [False, True])
def test_where_the_loss_kernel_runs_the_loss_is_the_chunked_loss_with_it(kernels_available, monkeypatch,
                                                                          vocab_multiple):
    config = replace(SMALL, vocab_size=1000)
    additions = ("loss_kernel", "vocab_multiple") if vocab_multiple else ("loss_kernel",)
    b = make(additions, config)
    assert b.notes == [] and type(b.model.loss) is modules.ChunkedLoss and b.model.loss.kernel
    assert b.model.loss.vocab_size == 1000
    # Prepared for the width the kernel will get: the (padded) output layer's rows, a multiple of 128.
    assert kernels_available == [("loss_kernel", loss_kernel.kernel_logits_width(b.config.padded_vocab_size))]
    monkeypatch.setattr(loss_kernel, "prepare", lambda device, n_cols: "the CUDA kernel could not be built")
    assert make(additions, config).notes == ["the CUDA kernel could not be built"]


def test_where_fp8_runs_fp8_head_is_the_fp8_loss_and_bf16_for_tokens_it_cannot_take(kernels_available,
                                                                                   monkeypatch):
    monkeypatch.setattr(fp8_loss, "unavailable", lambda device: None)   # as on an H200; a CPU emulates FP8
    b = make(("bf16", "fp8_head"))
    assert b.notes == [] and type(b.model.loss) is modules.ChunkedLoss and b.model.loss.fp8
    # The loss kernel is there for the steps FP8 cannot take, prepared as apply_loss_kernel prepares it.
    assert b.model.loss.kernel
    assert kernels_available == [("loss_kernel", loss_kernel.kernel_logits_width(b.config.padded_vocab_size))]
    b.model.loss.kernel = False   # its kernel needs a GPU: the chunked loss's own operations on this CPU
    g = torch.Generator().manual_seed(0)
    w = b.model.lm_head.weight.detach()
    for tokens in (32, 18):   # a multiple of 16: FP8's rounding; 18: the chunked loss in fp32, exact
        h = torch.randn(tokens, SMALL.n_embd, generator=g)
        y = torch.randint(0, SMALL.vocab_size, (tokens,), generator=g)
        got, want = b.model.loss(h, w, y), fp8_loss.reference(h, w, y, SMALL.vocab_size)
        if tokens % 16:
            assert torch.allclose(got, want, rtol=1e-5)
        else:   # e4m3 keeps 3 mantissa bits: close, and measurably not exact
            assert 0 < abs(got.item() - want.item()) < 0.01 * want.item()


@pytest.mark.parametrize("bases", [(), ("gemm_bias_grad", "gelu_epilogue")], ids=["plain", "max"])
def test_where_fp8_runs_fp8_qkv_fc_names_each_layernorm_to_the_layer_that_reads_it(kernels_available, monkeypatch,
                                                                                  bases):
    monkeypatch.setattr(fp8_linear, "unavailable", lambda device: None)
    b = make(("bf16",) + bases + ("fp8_qkv_fc",))
    assert b.notes == []
    for block in b.model.transformer.h:
        # The layers keep the features gemm_bias_grad gave them, and gelu_epilogue's MLP runs its c_fc's plan.
        assert (type(block.mlp) is modules.EpilogueMLP) == bool(bases)
        for layer, norm in ((block.attn.c_attn, block.ln_1), (block.mlp.c_fc, block.ln_2)):
            assert type(layer) is modules.PlannedLinear and layer.norm is norm
            assert layer.plan == LinearPlan(bias_grad=bool(bases), fp8_forward=True)
    assert set(b.model.state_dict()) == set(make(("bf16",) + bases).model.state_dict())


@pytest.mark.parametrize("bases", [(), ("gemm_bias_grad", "gelu_epilogue", "fp8_qkv_fc")], ids=["plain", "max"])
def test_where_fp8_runs_fp8_dgrad_plans_c_attn_and_c_fc_beside_their_other_features(kernels_available, monkeypatch,
                                                                                   bases):
    monkeypatch.setattr(fp8, "unavailable", lambda device: None)   # fp8_qkv_fc's check asks it too
    b = make(("bf16",) + bases + ("fp8_dgrad",), WIDE)
    assert b.notes == []
    for block in b.model.transformer.h:
        assert (type(block.mlp) is modules.EpilogueMLP) == bool(bases)
        for layer in (block.attn.c_attn, block.mlp.c_fc):
            assert type(layer) is modules.PlannedLinear
            assert layer.plan == LinearPlan(bias_grad=bool(bases), fp8_forward=bool(bases), fp8_dgrad=True)
        assert type(block.attn.c_proj) is type(block.mlp.c_proj) is nn.Linear
    assert set(b.model.state_dict()) == set(make(("bf16",), WIDE).model.state_dict())


@pytest.mark.parametrize("width", [SMALL.n_embd, 1024])
def test_fp8_dgrad_leaves_a_model_no_wider_than_1024_in_bf16_and_says_why(kernels_available, monkeypatch, width):
    monkeypatch.setattr(fp8, "unavailable", lambda device: None)
    b = make(("bf16", "gemm_bias_grad", "gelu_epilogue", "fp8_qkv_fc", "fp8_dgrad"),
             replace(SMALL, n_embd=width, n_head=8))
    assert b.notes == [f"FP8 input gradients pay only at a width over 1024 (this model's is {width}): c_attn's and "
                       f"c_fc's input gradients in bf16"]
    for block in b.model.transformer.h:
        for layer in (block.attn.c_attn, block.mlp.c_fc):
            assert layer.plan == LinearPlan(bias_grad=True, fp8_forward=True)


@pytest.mark.parametrize("n, k, takes", [
    (3 * 768, 768, False), (4 * 768, 768, False),          # GPT-2 124M's c_attn and c_fc
    (3 * 1024, 1024, False), (4 * 1024, 1024, False),      # gpt2-medium's: K at the limit
    (3 * 1280, 1280, True), (4 * 1600, 1600, True),        # gpt2-large's c_attn, gpt2-xl's c_fc
    (2048, 4096, False), (2064, 1040, True),               # N at the limit, both just over it
])
def test_fp8_dgrad_takes_a_layer_only_where_both_dimensions_are_over_their_limits(n, k, takes):
    assert ADDITIONS["fp8_dgrad"].takes_layer(n, k) is takes
    assert ADDITIONS["fp8_qkv_fc"].takes_layer(n, k)   # no limits: every layer


def test_a_width_rule_that_is_not_two_ints_is_refused():
    with pytest.raises(ValueError, match="layers_wider_than is"):
        Addition("x", "model", "compute", "x", layers_wider_than=(2048,))


def test_where_fp8_cannot_run_fp8_head_is_the_loss_kernel_in_bf16(kernels_available, monkeypatch):
    monkeypatch.setattr(fp8_loss, "unavailable", lambda device: "no FP8 here")
    b = make(("bf16", "fp8_head"))
    assert b.notes == ["no FP8 here: the output layer in bf16 instead, through the loss kernel"]
    assert type(b.model.loss) is modules.ChunkedLoss and b.model.loss.kernel and not b.model.loss.fp8
    assert kernels_available == [("loss_kernel", loss_kernel.kernel_logits_width(b.config.padded_vocab_size))]
    # Neither FP8 nor the loss kernel: the plain chunked loss, and both reasons.
    monkeypatch.setattr(loss_kernel, "unavailable", lambda device: "no kernel compiler")
    b = make(("bf16", "fp8_head"))
    assert b.notes == ["no FP8 here: the output layer in bf16 instead; "
                       "no kernel compiler: the plain chunked loss instead"]
    _chunked_loss(b, make(("bf16",)))


# ------------------------------------------------------------------------------------ optimizer and update

def _check_hyperparameters(b):
    decay, no_decay = b.optimizer.param_groups
    # Weight decay on matrices only (nanoGPT); nanoGPT's GPT-2 124M settings, the same on every rung.
    assert decay["weight_decay"] == apply.WEIGHT_DECAY == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert b.optimizer.defaults["lr"] == apply.LEARNING_RATE == 6e-4
    assert tuple(b.optimizer.defaults["betas"]) == apply.BETAS == (0.9, 0.95)
    assert b.optimizer.defaults["eps"] == apply.EPS == 1e-8
    n = sum(p.numel() for g in b.optimizer.param_groups for p in g["params"])
    assert n == b.model.num_params(exclude_position_embedding=False)


@pytest.mark.parametrize("additions, optimizer", [((), "AdamW"), (("fused",), "AdamW"), (("8bit",), "AdamW8bit")])
def test_every_optimizer_gets_the_same_hyperparameters(additions, optimizer):
    b = make(additions)
    assert type(b.optimizer).__name__ == optimizer
    assert bool(getattr(b.optimizer, "defaults", {}).get("fused")) == ("fused" in additions)
    _check_hyperparameters(b)


@pytest.mark.parametrize("additions", [(), ("fused",), ("8bit",)])
def test_the_update_clips_to_grad_clip_then_steps(additions):
    b = make(additions)
    seen = []

    class Recorder:
        def step(self):
            seen.append(torch.nn.utils.get_total_norm([p.grad for p in b.model.parameters()]).item())

    b.optimizer = Recorder()   # the update finds the optimizer on the build when it runs
    idx = torch.zeros(1, 8, dtype=torch.long)
    b.model(idx, idx)[1].mul(1e3).backward()
    b.update()
    assert seen == [pytest.approx(GRAD_CLIP, rel=1e-4)]


def _two_updates(additions):
    b = make(additions)
    idx = torch.randint(0, SMALL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    norms = []
    for _ in range(2):
        b.model(idx, idx)[1].mul(100).backward()     # a loss scaled so that the clip at norm 1.0 acts
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in b.model.parameters()]).item())
        b.update()
        b.optimizer.zero_grad(set_to_none=True)
    return b, norms


@pytest.mark.parametrize("optimizer", [(), ("fused",)], ids=["adamw", "fused"])
def test_the_compiled_update_clips_and_steps_as_the_eager_one(optimizer):
    eager, norms = _two_updates(("torch_compile",) + optimizer)
    assert min(norms) > 10 * GRAD_CLIP
    compiled, _ = _two_updates(("torch_compile", "compiled_update") + optimizer)
    assert eager.notes == compiled.notes == []
    assert hasattr(compiled.update, "_torchdynamo_orig_callable")
    # Two steps move a weight by up to 2 x lr = 1.2e-3; the traced AdamW may round differently from the
    # eager one by well under a thousandth of that.
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert (a - b).abs().max().item() <= 1e-6, name


def test_the_8bit_optimizer_update_stays_eager_and_says_so():
    b = make(FLASH + ("8bit", "compiled_update"))
    assert type(b.optimizer).__name__ == "AdamW8bit"
    assert any("not traceable" in note for note in b.notes), b.notes
    assert not hasattr(b.update, "_torchdynamo_orig_callable")


def test_torch_compile_needs_a_cpp_compiler_on_a_cpu(monkeypatch):
    monkeypatch.setattr(apply.shutil, "which", lambda name: None)
    for additions in (("torch_compile",), ("torch_compile", "compiled_update")):
        with pytest.raises(Unavailable, match=r"C\+\+ compiler"):
            make(additions)


# -------------------------------------------------------------------------------------------------- fp8

def _fp8_build(device):
    torch.manual_seed(0)
    return Build(device=device, config=SMALL, additions=("bf16", "fp8"), model=GPT(SMALL))


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(Unavailable, match="compute capability 8.9"):
        make(("bf16", "fp8"))
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    b = _fp8_build(cuda)
    with pytest.raises(Unavailable, match="compute capability 8.9"):
        apply.apply_fp8(b)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)      # torchao not installed: its import fails
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(Unavailable, match="pip install torchao") as e:
        apply.apply_fp8(b)
    assert "\n" not in str(e.value)
    # Refused, it changed nothing: every linear layer is still torch's.
    assert all(type(m) is nn.Linear for m in b.model.modules() if isinstance(m, nn.Linear))


def test_fp8_converts_the_blocks_linear_layers_only(monkeypatch):
    seen = []

    def convert(model, module_filter_fn):
        seen.extend(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and module_filter_fn(m, fqn))
        return model

    fake = types.ModuleType("torchao.float8")
    fake.convert_to_float8_training = convert
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    b = _fp8_build(torch.device("cuda"))
    assert apply.apply_fp8(b) is None
    blocks = [f"transformer.h.{i}.{name}" for i in range(SMALL.n_layer)
              for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(seen) == sorted(blocks)           # the tied output layer stays in bf16


# ======================================================================================= the swapped modules

MODEL_STAGE = [a for a in ADDITIONS if ADDITIONS[a].stage == "model" and a != "fp8"]   # fp8: torchao's swap
MAX_MODEL_STAGE = tuple(a for a in resolve(RUNGS["max"].additions) if ADDITIONS[a].stage == "model")


@pytest.mark.parametrize("additions", [tuple(requirements(a)) for a in MODEL_STAGE] + [MAX_MODEL_STAGE],
                         ids=MODEL_STAGE + ["max"])
def test_swaps_keep_the_models_parameters_and_their_tying(kernels_available, additions):
    # The swapped-in modules hold the same Parameter objects: the weights drawn at init, their tying, a
    # checkpoint's keys and the optimizer's view of the model are those of the plain model.
    torch.manual_seed(0)
    model = GPT(SMALL)
    before = list(model.named_parameters())
    keys = list(model.state_dict())
    scaled = {name for name, m in model.named_modules() if getattr(m, "residual_scale", False)}
    b = Build(device=CPU, config=SMALL, additions=additions, model=model)
    for name in resolve(("bf16", "flash") + additions):
        if ADDITIONS[name].stage == "model":
            apply.APPLY[name](b)
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in before]
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.transformer.wte.weight
    assert {name for name, m in model.named_modules() if getattr(m, "residual_scale", False)} == scaled


def _sdpa_kernel_spy(monkeypatch):
    backends = []

    def spy(backend):
        backends.append(backend)
        return contextlib.nullcontext()   # a CPU has no cuDNN attention: record the request, run plain SDPA

    monkeypatch.setattr(modules, "sdpa_kernel", spy)
    return backends


SWAPS = [("gemm_bias_grad",), ("gelu_epilogue",), ("gemm_bias_grad", "gelu_epilogue"), ("packed_attention",),
         ("gemm_bias_grad", "packed_attention"), ("cudnn_attention",), ("loss",), ("vocab_multiple", "loss"),
         # max's swaps; its parameters' storage in bf16 (an optimizer's layout, not a module) cannot be float64
         tuple(a for a in MAX_MODEL_STAGE if not ADDITIONS[a].optimizer)]


@pytest.mark.parametrize("additions", SWAPS, ids=["+".join(a) for a in SWAPS])
def test_swapped_model_gives_the_plain_models_loss_and_gradients_in_float64(monkeypatch, additions):
    backends = _sdpa_kernel_spy(monkeypatch)
    monkeypatch.setattr(chunked_loss, "CHUNK_ROWS", 20)   # several chunks, the last one short
    # SDPA on both sides where the swap replaces SDPA (cudnn_attention needs the flash rung's attention).
    common = ("flash",) if "cudnn_attention" in additions else ()
    plain, changed, x, y = model_pair(additions, common=common)
    swapped = {type(m) for m in changed.modules()} - {type(m) for m in plain.modules()}
    assert swapped or "bf16_residual" in additions, "nothing was swapped in"
    losses = []
    for model in (plain, changed):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), b in zip(plain.named_parameters(), changed.parameters()):
        torch.testing.assert_close(b.grad[:a.shape[0]], a.grad, rtol=1e-9, atol=1e-12, msg=name)
    if "cudnn_attention" in additions:
        assert backends == [modules.SDPBackend.CUDNN_ATTENTION] * SMALL.n_layer
    # Without targets, the logits over the real vocabulary, as the plain model's.
    with torch.no_grad():
        torch.testing.assert_close(changed(x)[0], plain(x)[0], rtol=1e-12, atol=1e-12)


def test_a_run_name_gives_back_its_additions():
    for names in [(), RUNGS["8bit"].additions, RUNGS["fused"].additions + ("loss_kernel",), ("loss", "prefetch"),
                  ("bf16", "flash"), RUNGS["max"].additions]:
        assert set(additions_of(run_name(names))) == set(names)
    assert additions_of("fused+warp_drive") is None and additions_of("custom") is None
    assert additions_of("fused+loss") == RUNGS["fused"].additions + ("loss",)   # the ablation's recorded names


def test_the_max_rung_and_fsdp_s_refusals_come_from_each_addition_s_facts():
    from Utils.ladder.registry import MAX_ADDITIONS, PARALLEL_EXCLUDES
    assert MAX_ADDITIONS == tuple(a for a in ADDITIONS if ADDITIONS[a].in_max)
    assert set(RUNGS["max"].additions) == set(RUNGS["fused"].additions) | {
        "vocab_multiple", "fp8_head", "prefetch", "sync_every", "cudagraphs", "bf16_residual", "gelu_epilogue",
        "fold_clip", "packed_attention", "gemm_bias_grad", "fp8_qkv_fc", "fp8_dgrad", "combo_kernels", "fold_norm",
        "stochastic_rounding"}
    assert PARALLEL_EXCLUDES["ddp"] == {}
    assert PARALLEL_EXCLUDES["fsdp"] == {a: ADDITIONS[a].fsdp for a in ADDITIONS if ADDITIONS[a].fsdp}
    assert set(PARALLEL_EXCLUDES["fsdp"]) == {"gemm_bias_grad", "gelu_epilogue", "packed_attention", "loss_kernel",
                                              "fp8_head", "recompute_logits", "fp8_qkv_fc", "fp8_dgrad", "fold_clip",
                                              "fold_norm", "8bit", "cudagraphs", "fp8", "master_weights",
                                              "stochastic_rounding"}
