"""Utils.report.roofline: the model's shape and parameters without torch, the compute and memory floors on
synthetic configurations and on the committed H200 measurements, and the counts of PyTorch's own operations
it records, counted again here on the installed torch under a TorchDispatchMode."""
import os
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from Utils.ladder.registry import ADDITIONS, LADDER, RUNGS
from Utils.report import roofline
from Utils.report.breakdown import load_breakdown
from Utils.report.roofline import ModelShape, Roofline
from Utils.report.stats import build_report
from Utils.results.gpus import gpu_spec
from Utils.results.metrics import flops_per_token
from Utils.results.read import load

from conftest import REPO_ROOT

GPT2 = ModelShape(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)
XL = ModelShape(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024)
TINY = ModelShape(n_layer=2, n_head=2, n_embd=64, vocab_size=50257, block_size=128)
H200_SETS = [os.path.join(REPO_ROOT, "results", name) for name in ("h200-b16", "h200-b64", "h200-loss")]


def h200_roof(batch=16, gpu="NVIDIA H200"):
    return Roofline(GPT2, batch, 1024, gpu)


# ---------------------------------------------------------------------------------------------
# The model's shape


def test_gpt2_parameters_are_counted_as_the_model_counts_them():
    assert GPT2.n_params(exclude_position_embedding=False) == 124_439_808   # runs.csv's n_params
    assert GPT2.n_params() == 124_439_808 - 1024 * 768
    assert len(GPT2.parameters()) == 2 + 12 * 12 + 2 == len(GPT2.param_sizes())
    assert GPT2.head_dim == 64


def test_presets_are_the_models():
    shapes = roofline.presets()
    assert list(shapes) == ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    assert shapes["gpt2"] == GPT2 and shapes["tiny"] == TINY
    assert roofline.model_shape("gpt2-xl") == ModelShape(48, 25, 1600, 50257, 1024)
    assert roofline.model_shape("gpt3") is None


def test_matmul_precision():
    assert [roofline.matmul_precision(RUNGS[r].additions) for r in ("baseline", "tf32", "bf16", "max")] == \
           ["fp32", "tf32", "bf16", "bf16"]


# ---------------------------------------------------------------------------------------------
# The compute floor


def test_compute_floor_is_the_step_flops_over_the_table_peak():
    roof = h200_roof()
    h200 = gpu_spec("NVIDIA H200")
    step_flops = flops_per_token(GPT2.n_params(), 12, 12, 64, 1024) * 16 * 1024
    assert roof.flops_per_step == step_flops
    for precision, rate in (("fp32", h200.fp32), ("tf32", h200.tf32), ("bf16", h200.bf16)):
        assert roof.compute_floor_ms(precision) == pytest.approx(step_flops / rate * 1e3)
    assert roof.compute_floor_ms("bf16") == pytest.approx(14.16, abs=0.01)   # 14.01 TFLOP at 989.4 TFLOP/s
    with pytest.raises(ValueError, match="precision"):
        roof.compute_floor_ms("fp8")


def test_the_gemms_an_addition_runs_in_fp8_count_at_the_fp8_rate_where_the_gpu_has_one():
    roof = h200_roof()
    # From the model's parameter list: a weight [out, in] costs 2 FLOPs per value and token forward, 4 backward.
    weights = {name.split(".", 3)[-1] if name.startswith("transformer.h.") else name: size
               for (name, shape), size in zip(GPT2.parameters(), GPT2.param_sizes()) if len(shape) == 2}
    head = 6 * weights["transformer.wte.weight"]                                   # the tied output layer
    qkv_fc = 12 * 2 * (weights["attn.c_attn.weight"] + weights["mlp.c_fc.weight"])  # forward only, 12 layers
    block = 12 * 6 * sum(weights[n] for n in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                              "mlp.c_proj.weight"))
    assert roof.fp8_flops_per_token(["bf16", "fp8_head"]) == head
    assert roof.fp8_flops_per_token(RUNGS["max"].additions) == head + qkv_fc
    assert roof.fp8_flops_per_token(["bf16", "fp8"]) == block
    # fp8_dgrad takes no layer of 124M's (K = 768), and the same GEMMs' input gradients at gpt2-xl's width
    assert roof.fp8_flops_per_token(["bf16", "fp8_dgrad"]) == 0
    xl = Roofline(XL, 8, 1024, "NVIDIA H200")
    assert xl.fp8_flops_per_token(["bf16", "fp8_dgrad"]) == xl.fp8_flops_per_token(["bf16", "fp8_qkv_fc"]) \
        == 48 * 2 * (3 + 4) * 1600 * 1600
    assert roof.fp8_flops_per_token(RUNGS["fused"].additions) == 0
    # Every addition that the registry marks as running FP8 GEMMs has them counted here, at a width it takes.
    assert all(xl.fp8_flops_per_token([a]) > 0 for a in ADDITIONS if ADDITIONS[a].fp8)
    fp8 = (head + qkv_fc) * roof.tokens
    want = ((roof.flops_per_step - fp8) / roof.gpu.bf16 + fp8 / roof.gpu.fp8) * 1e3
    assert roof.compute_floor_ms("bf16", RUNGS["max"].additions) == pytest.approx(want)
    assert roof.compute_floor_ms("bf16", RUNGS["max"].additions) < roof.compute_floor_ms("bf16")
    floors = roof.floors({"max": 29.2, "fused": 36.0})
    assert (floors.at["max", "matmuls"], floors.at["fused", "matmuls"]) == ("bf16+fp8", "bf16")
    assert floors.at["max", "compute floor ms"] == pytest.approx(want)
    # Where the GPU has no FP8 units, the additions fall back to bf16, and so does the floor.
    a100 = h200_roof(gpu="NVIDIA A100-SXM4-80GB")
    assert a100.floors({"max": 90.0}).at["max", "matmuls"] == "bf16"
    assert a100.compute_floor_ms("bf16", RUNGS["max"].additions) == pytest.approx(a100.compute_floor_ms("bf16"))
    # The FP8 rate is printed with the others where the GPU has one, and is no missing figure where it has none.
    h200_lines = roofline.machine_lines("NVIDIA H200")
    assert any(line.startswith("NVIDIA H200 fp8") and "1979.0 TFLOP/s" in line for line in h200_lines)
    assert not any(" fp8 " in line for line in roofline.machine_lines("NVIDIA A100-SXM4-80GB"))
    assert roofline.missing_figures("NVIDIA A100-SXM4-80GB") == []


def test_a_run_is_floored_by_the_additions_it_recorded_not_its_rungs_today():
    roof = h200_roof()
    then = RUNGS["fused"].additions + ("loss_kernel",)   # a max of another time: bf16 only, no folded clip
    floors = roof.floors({"max": 29.2}, {"max": then})
    assert floors.at["max", "matmuls"] == "bf16"
    assert floors.at["max", "memory floor ms"] == pytest.approx(roof.memory_floor_ms(then))
    assert floors.at["max", "memory floor ms"] != pytest.approx(roof.memory_floor_ms(RUNGS["max"].additions))


def test_a_gpu_missing_from_the_table_gets_no_floor_rather_than_a_guess():
    roof = h200_roof(gpu="NVIDIA Tesla T4")
    assert roof.gpu is None
    assert all(roof.compute_floor_ms(p) is None for p in roofline.PRECISIONS)
    assert roof.memory_floor_ms(()) is None
    floors = roof.floors({"baseline": 300.0, "bf16": 120.0})
    assert floors[["compute floor ms", "memory floor ms"]].isna().all().all()
    assert floors["total GB"].gt(0).all()                 # the traffic itself is still counted
    assert roofline.bound(floors.loc["bf16"]) is None
    assert "no floor known for NVIDIA Tesla T4" in roofline.verdict("bf16", floors.loc["bf16"], "NVIDIA Tesla T4")
    assert roofline.missing_figures("NVIDIA Tesla T4") == ["fp32", "tf32", "bf16", "bandwidth"]
    assert all(line.endswith("unknown") for line in roofline.machine_lines("NVIDIA Tesla T4"))


def test_a_figure_missing_for_a_known_gpu_leaves_out_only_that_floor():
    roof = h200_roof(gpu="NVIDIA B200")      # the table has B200's bf16 rate, not its tf32 or fp32 ones
    assert roof.compute_floor_ms("tf32") is None and roof.compute_floor_ms("fp32") is None
    assert roof.compute_floor_ms("bf16") == pytest.approx(roof.flops_per_step / 2250e12 * 1e3)
    assert roofline.missing_figures("NVIDIA B200") == ["fp32", "tf32"]
    floors = roof.floors({"tf32": 100.0, "bf16": 50.0})
    assert np.isnan(floors.at["tf32", "compute floor ms"]) and np.isfinite(floors.at["tf32", "memory floor ms"])
    assert roofline.bound(floors.loc["tf32"]) is None
    assert roofline.bound(floors.loc["bf16"]) in ("compute", "memory")


# ---------------------------------------------------------------------------------------------
# The memory floor


def test_traffic_follows_the_additions():
    roof = h200_roof()
    base, bf16 = roof.traffic(RUNGS["baseline"].additions), roof.traffic(RUNGS["bf16"].additions)
    compiled, flash = roof.traffic(RUNGS["torch_compile"].additions), roof.traffic(RUNGS["flash"].additions)
    assert bf16["activations"] == base["activations"] / 2 and bf16["logits"] == base["logits"] / 2
    assert bf16["scores"] == base["scores"] / 2
    passes = roofline.COMPILED_SCORE_PASSES / roofline.EAGER_SCORE_PASSES
    assert compiled["scores"] / bf16["scores"] == pytest.approx(passes)
    assert flash["scores"] == 0
    # One layer's scores in fp32, 19 passes, 12 layers: the baseline's largest part.
    assert base["scores"] == 16 * 12 * 1024 * 1024 * 12 * roofline.EAGER_SCORE_PASSES * 4
    assert max(base, key=base.get) == "scores"
    optimizer = {r: roof.traffic(RUNGS[r].additions)["optimizer"] for r in ("flash", "fused", "8bit", "max")}
    # max stores the parameters in bf16 with bf16 states (stochastic_rounding): half the fused update's bytes
    assert optimizer["max"] == optimizer["fused"] / 2 < optimizer["8bit"] < optimizer["fused"] < optimizer["flash"]
    assert roof.traffic(RUNGS["max"].additions)["weights+grads+clip"] < flash["weights+grads+clip"]
    for name in ("packed_attention", "cudnn_attention"):
        assert roof.score_passes(("bf16", name)) == 0


def test_optimizer_bytes_per_parameter():
    roof = h200_roof()
    n_all = GPT2.n_params(exclude_position_embedding=False)
    vectors = sum(n for (_, shape), n in zip(GPT2.parameters(), GPT2.param_sizes()) if len(shape) == 1)
    assert roof.foreach_adamw_bytes_per_param() == pytest.approx(84 - 8 * vectors / n_all)
    assert round(roof.foreach_adamw_bytes_per_param()) == 84
    assert roof.optimizer_bytes_per_param(RUNGS["fused"].additions) == roofline.FUSED_ADAMW_BYTES == 28
    # Every matrix of GPT-2 is large enough for 8-bit states; no bias or LayerNorm is.
    assert roof.params_in_8bit_tensors() == n_all - vectors
    assert roof.eight_bit_bytes_per_param() == pytest.approx((16 * (n_all - vectors) + 28 * vectors) / n_all)
    assert len(roofline.foreach_adamw_ops(True)) == 9 and len(roofline.foreach_adamw_ops(False)) == 8


def test_master_weights_bytes_per_parameter():
    """bf16 parameters: 2-byte weights read twice and gradients written once, a 2-byte norm read under the
    folded clip, and 28 bytes in the update (bf16 gradient in, fp32 master, m and v in and out, bf16 out)."""
    roof = h200_roof()
    n_all = GPT2.n_params(exclude_position_embedding=False)
    max_ = tuple(a for a in RUNGS["max"].additions if a != "stochastic_rounding")   # fp32 parameters
    before, after = roof.traffic(max_), roof.traffic(max_ + ("master_weights",))
    assert before["weights+grads+clip"] == n_all * (12 + 8) and after["weights+grads+clip"] == n_all * (6 + 2)
    assert roof.optimizer_bytes_per_param(max_ + ("master_weights",)) == 28
    without_fold = tuple(a for a in max_ if a != "fold_clip") + ("master_weights",)
    assert roof.traffic(without_fold)["weights+grads+clip"] == n_all * (6 + 6)
    assert {k: v for k, v in after.items() if k != "weights+grads+clip"} == \
        {k: v for k, v in before.items() if k != "weights+grads+clip"}


def test_stochastic_rounding_bytes_per_parameter():
    """No masters: the update reads the bf16 gradient, parameter, m and v and writes the last three, 14 bytes; the
    weights' and gradients' traffic is master_weights'."""
    roof = h200_roof()
    max_ = RUNGS["max"].additions
    assert "stochastic_rounding" in max_
    fp32_max = tuple(a for a in max_ if a != "stochastic_rounding")
    assert roof.optimizer_bytes_per_param(max_) == 14
    mw = roof.traffic(fp32_max + ("master_weights",))
    assert roof.traffic(max_)["weights+grads+clip"] == mw["weights+grads+clip"]


def test_floors_frame():
    roof = h200_roof()
    floors = roof.floors({"baseline": 369.3, "tf32": 155.5, "max": 29.2, "fused+loss": 37.5, "mine": 1.0})
    assert list(floors.index) == ["baseline", "tf32", "max", "fused+loss"]   # "mine" has no known additions
    assert list(floors.columns) == roofline.FLOOR_COLUMNS
    parts = [c for c in roofline.FLOOR_COLUMNS if c.endswith(" GB") and c != "total GB"]
    assert np.allclose(floors[parts].sum(axis=1), floors["total GB"])
    assert np.allclose(floors["memory floor ms"], floors["total GB"] * 1e9 / 4.8e12 * 1e3)
    assert floors.at["tf32", "matmuls"] == "tf32"
    assert floors.at["tf32", "compute floor ms"] == pytest.approx(roof.compute_floor_ms("tf32"))
    assert floors.at["max", "measured ms"] == 29.2


# ---------------------------------------------------------------------------------------------
# What the floors say


def row(compute, memory, measured, matmuls="bf16"):
    return pd.Series({"compute floor ms": compute, "memory floor ms": memory, "measured ms": measured,
                      "matmuls": matmuls})


def test_bound_and_verdict():
    assert roofline.bound(row(14.2, 6.5, 29.2)) == "compute"
    assert roofline.bound(row(14.2, 27.3, 140.7)) == "memory"
    text = roofline.verdict("max", row(14.2, 6.5, 29.2), "GPU")
    assert text.startswith("max: 29.2 ms measured; compute floor 14.2 ms (bf16), memory floor 6.5 ms.")
    assert "sits against the compute floor, at 2.1× it (and 4.5× the memory floor); 15.0 ms are kernels" in text
    assert "close to what this GPU can do" in roofline.verdict("r", row(10.0, 2.0, 12.0), "GPU")
    assert "runs below the memory floor" in roofline.verdict("r", row(1.0, 20.0, 12.0), "GPU")
    assert "at 2.0× it; 6.0 ms" in roofline.verdict("r", row(np.nan, 6.0, 12.0), "GPU")
    assert roofline.verdict("r", row(1.0, 2.0, np.nan), "GPU", "oom") == "r: no measured step time (oom)."


def test_eager_launches_count_the_uncompiled_runs_only():
    roof = h200_roof()
    launches = roofline.eager_launches(roof, {"baseline": 369.3, "bf16": 140.7, "fused": 36.9, "tf32": np.nan})
    assert list(launches.index) == ["baseline", "bf16"]
    ops = roofline.EAGER_OPS_FIXED + 12 * roofline.EAGER_OPS_PER_LAYER["written out"] + roofline.optimizer_ops_per_step()
    assert (launches["operations"] == ops).all() and ops == 534 + 25
    assert launches.at["baseline", "µs of GPU work per operation"] == pytest.approx(369.3e3 / ops)
    assert "overhead does not bound the eager runs" in roofline.overhead_verdict(launches)
    tiny = pd.DataFrame({"operations": [559], "ms": [2.0], "µs of GPU work per operation": [2e3 / 559]})
    assert "overhead bounds those runs" in roofline.overhead_verdict(tiny)
    assert roofline.overhead_verdict(launches.iloc[0:0]).startswith("No eager run")


def test_against_breakdown_and_the_chart():
    roof = h200_roof()
    floors = roof.floors({"baseline": 369.3, "flash": 38.9})
    split = pd.DataFrame({"rung": ["flash", "flash", "baseline", "baseline", "fused"],
                          "class": ["compute", "memory", "compute", "memory", "compute"],
                          "ms_per_step": [20.0, 15.0, 288.0, 78.0, 20.0]})
    table = roofline.against_breakdown(floors, split)
    assert list(table.index) == ["baseline", "flash", "fused"]
    ratio = table.at["flash", "compute floor ms / compute ms"]
    assert ratio == pytest.approx(floors.at["flash", "compute floor ms"] / 20)
    assert np.isnan(table.at["fused", "compute floor ms / compute ms"])   # no floors for a run not in the table
    assert isinstance(roofline.plot_floors(floors, {}, "title"), Figure)
    assert roofline.plot_floors(roof.floors({"baseline": np.nan}), {}, "title") is None


# ---------------------------------------------------------------------------------------------
# The committed H200 measurements


@pytest.mark.parametrize("prefix", H200_SETS, ids=os.path.basename)
def test_every_measured_step_is_slower_than_both_its_floors(prefix):
    report = build_report(*load(prefix))
    roof = Roofline.from_run(report.reference)
    assert roof.shape == GPT2 and roof.gpu == gpu_spec("NVIDIA H200")
    assert roof.shape.n_params(exclude_position_embedding=False) == int(report.reference["n_params"])
    floors = roof.floors(report.table["median_step_ms"].to_dict())
    measured = [r for r in floors.index if np.isfinite(floors.at[r, "measured ms"])]
    assert set(measured) >= {r for r in LADDER if r in report.table.index and report.table.at[r, "status"] == "ok"}
    for r in measured:
        assert floors.at[r, "compute floor ms"] < floors.at[r, "measured ms"], r
        assert floors.at[r, "memory floor ms"] < floors.at[r, "measured ms"], r
        assert roofline.bound(floors.loc[r]) in ("compute", "memory")
    # The baseline runs FP32 matmuls on the FP32 units: its compute floor alone is most of its step.
    assert floors.at["baseline", "compute floor ms"] > 0.5 * floors.at["baseline", "measured ms"]
    assert roofline.bound(floors.loc["baseline"]) == "compute" and roofline.bound(floors.loc["bf16"]) == "memory"


def test_the_profiled_compute_time_is_never_below_the_compute_floor():
    prefix = os.path.join(REPO_ROOT, "results", "h200-b16")
    report = build_report(*load(prefix))
    floors = Roofline.from_run(report.reference).floors(report.table["median_step_ms"].to_dict())
    table = roofline.against_breakdown(floors, load_breakdown(prefix))
    assert set(LADDER) <= set(table.index)
    assert (table["compute floor ms / compute ms"] < 1).all()


# ---------------------------------------------------------------------------------------------
# The counts of PyTorch's own operations, counted again on the installed torch


@pytest.fixture(scope="module")
def counter():
    """A TorchDispatchMode that records (op, values read, values written) of every ATen operation, views and
    bookkeeping left out, counting only the tensors `keep` accepts and measuring them with `size`."""
    import torch   # a dependency: the report modules alone go without it
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Counter(TorchDispatchMode):
        def __init__(self, keep=lambda t: True, size=lambda t: t.numel() * t.element_size()):
            super().__init__()
            self.keep, self.size, self.ops = keep, size, []

        def measure(self, obj):
            return sum(self.size(t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and self.keep(t))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view or func.__name__.startswith(("_unsafe_view", "_local_scalar_dense", "_record_function")):
                return out
            schema = func._schema
            named = {**dict(zip([a.name for a in schema.arguments], args)), **kwargs}
            written = sum(self.measure(named.get(a.name)) for a in schema.arguments
                          if a.alias_info is not None and a.alias_info.is_write)
            outs = out if isinstance(out, tuple) else (out,)
            written += sum(self.measure(o) for o, r in zip(outs, schema.returns) if r.alias_info is None)
            read = self.measure((args, kwargs))
            if read or written:
                self.ops.append((func.__name__, read, written))
            return out
    return Counter


def test_the_written_out_attention_touches_its_scores_as_recorded(counter):
    import torch
    from Utils.model import CausalSelfAttention
    from Utils.model_config import PRESETS
    b, h, t, c = 2, 2, 24, 64

    def score_ops(flash):
        layer = CausalSelfAttention(replace(PRESETS["gpt2"], block_size=t, n_layer=1, n_head=h, n_embd=c, flash=flash))
        x = torch.randn(b, t, c, requires_grad=True)
        with counter(keep=lambda u: u.dim() >= 2 and tuple(u.shape[-2:]) == (t, t) and u.numel() >= b * h * t * t,
                     size=lambda u: u.numel()) as count:
            layer(x).sum().backward()
        return [(op, r / (b * h * t * t), w / (b * h * t * t)) for op, r, w in count.ops]

    assert score_ops(flash=False) == list(roofline.EAGER_SCORE_OPS)
    assert score_ops(flash=True) == []


@pytest.mark.parametrize("n_layer", [1, 3])
def test_one_eager_step_runs_the_recorded_number_of_operations(counter, n_layer):
    import torch
    from Utils.model import GPT
    from Utils.model_config import PRESETS
    for flash in (False, True):
        # The count depends on the layers only: a narrow model with a small vocabulary serves.
        cfg = replace(PRESETS["gpt2"], n_layer=n_layer, n_embd=96, vocab_size=64, block_size=16, flash=flash)
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (1, 16))
        with counter() as count:
            _, loss = model(idx, idx)
            loss.backward()
        assert len(count.ops) == roofline.eager_ops_per_step(n_layer, flash), (n_layer, flash)


def test_the_clip_and_foreach_adamw_move_the_recorded_bytes(counter):
    import torch
    from Utils.ladder.apply import BETAS, EPS, GRAD_CLIP, LEARNING_RATE, param_groups
    from Utils.model import GPT
    from Utils.model_config import PRESETS
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    n = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(param_groups(model), lr=LEARNING_RATE, betas=BETAS, eps=EPS, foreach=True)
    opt.step()   # the first step creates the states; the second is the one counted
    with counter() as clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    with counter() as step:
        opt.step()
    assert [op for op, _, _ in clip.ops] == list(roofline.CLIP_OPS)
    assert sum(r + w for _, r, w in clip.ops) / n == pytest.approx(roofline.CLIP_BYTES, rel=1e-3)
    assert [op for op, _, _ in step.ops] == roofline.foreach_adamw_ops(True) + roofline.foreach_adamw_ops(False)
    tiny = Roofline(TINY, 1, 16, "NVIDIA H200")
    assert sum(r + w for _, r, w in step.ops) / n == pytest.approx(tiny.foreach_adamw_bytes_per_param(), rel=1e-3)


def test_the_shapes_match_the_models_parameters():
    import torch   # a dependency: the report modules alone go without it
    from Utils.model import GPT
    from Utils.model_config import PRESETS
    assert set(roofline.presets()) == set(PRESETS)
    for name, config in PRESETS.items():
        shape = roofline.presets()[name]
        assert shape == ModelShape(config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.block_size)
        with torch.device("meta"):
            model = GPT(config)
        assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == shape.parameters(), name
        assert shape.n_params() == model.num_params()
        assert shape.n_params(exclude_position_embedding=False) == model.num_params(exclude_position_embedding=False)


def test_every_addition_the_traffic_model_names_exists():
    named = roofline.ATTENTION_WITHOUT_SCORES | roofline.FUSED_OPTIMIZERS | {"bf16", "tf32", "torch_compile", "8bit"}
    assert named <= set(ADDITIONS)


def test_the_roofline_reads_each_addition_s_facts_from_the_registry():
    assert roofline.ATTENTION_WITHOUT_SCORES == {"flash", "packed_attention", "cudnn_attention"}
    assert roofline.FUSED_OPTIMIZERS == {"fused", "fold_clip"}
    assert roofline.EIGHT_BIT_OPTIMIZERS == {"8bit"} and roofline.FOLDED_CLIPS == {"fold_clip"}
    assert roofline.COMPILED == {"torch_compile"}
    assert {a: ADDITIONS[a].matmuls for a in ADDITIONS if ADDITIONS[a].matmuls} == {"tf32": "tf32", "bf16": "bf16"}
    assert {a: ADDITIONS[a].fp8_gemms for a in ADDITIONS if ADDITIONS[a].fp8_gemms} == {
        "fp8_head": "head", "fp8_qkv_fc": "qkv_fc", "fp8_dgrad": "qkv_fc_dgrad", "fp8": "blocks"}
