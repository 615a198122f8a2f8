"""Writes notebooks/Optimizing_GPU_Utilization.ipynb from the cells below, and executes it against a results folder.

    python notebooks/build_notebook.py                 build, execute against results/h200-b16, save with outputs
    python notebooks/build_notebook.py --no-execute    build only (no outputs)
    RESULTS=other python notebooks/build_notebook.py   execute against another results folder, save into it

The notebook's prose lives here, and each addition's own text in its registry entry (Utils/ladder/registry.py,
set as markdown by Utils.report.notebook_prose), so that a change to it is reviewed as text, not as JSON; its
code cells are short calls into Utils.report.walkthrough and Utils.report.roofline, which are tested like the
rest of the suite. The test suite checks that the committed .ipynb holds exactly these cells. Executing needs no
GPU and no torch: the notebook reads recorded measurements and source files only.

The saved file depends only on the cells and the results: cell ids are fixed, execution timing is not
recorded, the kernel's language_info is reset to the build's, adjacent stream outputs are merged (how a
kernel splits them depends on timing), and stderr is echoed here instead of being saved, so that running it
again against the same results leaves the checkout unchanged.
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import textwrap

# make install leaves the notebook's packages (requirements-notebook.txt) to make notebook and make test.
try:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
    if importlib.util.find_spec("ipykernel") is None:   # the kernel that executes the cells, found by name
        raise ImportError("ipykernel is missing", name="ipykernel")
except ImportError as e:
    sys.exit(f"error: building the notebook needs {e.name or e}: run make notebook, which installs "
             f"requirements-notebook.txt, or pip install -r requirements-notebook.txt")

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "Optimizing_GPU_Utilization.ipynb")
REPO = os.path.dirname(HERE)
if REPO not in sys.path:   # run as a script, this folder is on the path and the repository is not
    sys.path.insert(0, REPO)

from Utils.ladder.registry import ABLATION, ADDITIONS, MAX_ADDITIONS  # noqa: E402
from Utils.report import notebook_prose as prose  # noqa: E402

DEFAULT_RESULTS = os.path.join("results", "h200-b16")   # the committed notebook's measurements
CELL_TIMEOUT_S = 300
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
LANGUAGE_INFO = {"name": "python"}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str) -> nbformat.NotebookNode:
    return new_code_cell(textwrap.dedent(text).strip("\n"))


CELLS = [
    md(r"""
    # Optimizing GPU utilization: why each rung of the ladder is faster

    The suite trains GPT-2 (124M parameters) under a cumulative ladder of optimizations and records the
    time of every training step. This notebook explains those measurements. It starts from first
    principles (what bounds the time of a training step at all), then takes one rung at a time: the
    lines of `Utils/` that switch it on, why it is faster, what it costs, and what it did to step time,
    memory and loss. It ends with the charts and a short guide.

    Every number in the text is computed from the recorded files when the notebook runs, so re-measuring
    and re-running it (`python notebooks/build_notebook.py`, or `make notebook`) updates the prose too.
    It needs no GPU (nor torch) and runs in well under a minute. `RESULTS` in the first cell chooses the
    folder it reads (the environment variable of the same name overrides it). The computations live in
    `Utils/report/walkthrough.py` (the tables and sentences) and `Utils/report/roofline.py` (the floors),
    tested with the rest of the suite; the cells call them.
    """),
    code(r"""
    import os
    import sys
    from pathlib import Path

    # The repository root is the nearest folder at or above the kernel's working folder that holds Utils/.
    REPO = next((str(p) for p in (Path.cwd(), *Path.cwd().parents) if (p / "Utils").is_dir()), None)
    if REPO is None:
        raise RuntimeError(f"no folder holding Utils/ at or above {Path.cwd()}: start the notebook in the repository")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)

    import pandas as pd

    # roofline holds the constants the prose cites (roofline.ACTIVATIONS, roofline.EAGER_SCORE_OPS, ...).
    from Utils.report import roofline, walkthrough
    from Utils.report.walkthrough import show

    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)

    # A path relative to the current folder, or else to the repository root.
    RESULTS = walkthrough.results_folder(os.environ.get("RESULTS", os.path.join("results", "h200-b16")), REPO)
    """),
    code(r"""
    study = walkthrough.Study.load(RESULTS)
    show(*study.overview())
    """),
    md(r"""
    ## The measurements

    The report (`Utils.report.stats.build_report`, the one `make plots` draws from) picks one run per rung
    (the latest successful run with the baseline's batch, sequence length, model, data and GPU) and
    recomputes its median step time over the measured steps, warm-up left out. The table below is that
    frame; the speedup is the baseline's median over the rung's. The `NOTEBOOK_FIGURES` line is a
    machine-readable record of the same figures, rounded as `summary.md` rounds them: the tests compare the
    two.
    """),
    code(r"""
    show(*study.measurement_table())
    """),
    md(r"""
    ## First principles: compute, memory and overhead

    A training step spends its time in three ways:

    * **compute**: the floating-point operations of the matrix multiplications, at the rate of the units
      that run them (the tensor cores for TF32, BF16 and FP16; the ordinary FP32 units otherwise);
    * **memory**: the bytes that must travel between the GPU's memory (HBM) and its chip, at the memory
      bandwidth: every elementwise operation (a LayerNorm, a GELU, a softmax, an optimizer update) reads
      its inputs and writes its outputs, and does so little arithmetic per byte that bandwidth sets its pace;
    * **overhead**: everything else: the Python interpreter, PyTorch's dispatcher, kernel launches,
      synchronizations. The GPU idles whenever the CPU has not yet told it what to do next.

    Each gives a floor: FLOPs over the peak rate, bytes over the bandwidth. A step can be no faster than
    the larger of the two floors, and what it takes beyond that is kernels running below their peak
    plus overhead. Which floor a rung sits against says which kind of optimization can help it next:
    against compute, only fewer FLOPs or faster units (lower precision) help; against memory, fewer bytes
    (smaller types, fusion, not writing intermediates out); far above both, fewer and larger kernels.
    """),
    md(r"""
    ### The machine

    The floors need the GPU's peak rates and its memory bandwidth, all from the vendor's datasheet. The
    suite keeps one table of them, `Utils.results.gpus`: per GPU, the dense BF16, TF32 and FP32 rates and
    the memory bandwidth, with the document each comes from. MFU and the profiled breakdown read the same
    table. A figure the table lacks for this GPU is reported unknown, never estimated, and the floor that
    needs it is left out.
    """),
    code(r"""
    show(*study.machine())
    """),
    md(r"""
    ### Compute: FLOPs per token × tokens per step ÷ peak rate

    A token costs about 6N FLOPs in the matrix multiplications with weights (2N forward, 4N backward,
    N = parameters without the position embedding), plus the attention's own two matrix products,
    QKᵀ and AV, which grow with the sequence length (`Utils.results.metrics.flops_per_token`, after the
    PaLM paper). N is counted from the model's shape (`roofline.ModelShape`, the presets of
    `Utils/model_config.py`), tensor by tensor as the model holds them, without building the model; the count
    runs.csv recorded on the measuring machine is printed beside it.
    """),
    code(r"""
    show(*study.compute())
    """),
    md(r"""
    ### Memory: the bytes a step must move ÷ bandwidth

    This is an estimate of a floor, not a measurement. Its assumptions:

    1. **Weights, gradients, clipping.** Every rung but `max` keeps FP32 parameters. Forward reads each
       weight once, backward reads it again and writes its gradient (4 bytes each; 2 for `max`'s bf16
       parameters); gradient clipping reads the gradients for their norm, then reads and rewrites them
       scaled. The optimizer's traffic is counted below by running it.
    2. **Activations.** Per layer and token, backward needs the tensors listed in `roofline.ACTIVATIONS`
       (16 values per channel). Each is written once in forward and read once in backward; its gradient is
       written once and read once: 4 accesses, at 4 bytes per value on the FP32 rungs and 2 on the BF16
       ones. That is a floor: autocast keeps LayerNorm, softmax and the loss in FP32.
    3. **Logits.** B·T·vocabulary values, with the same 4 accesses.
    4. **Attention scores**, with the written-out attention only (no `flash`): B·H·T·T values per layer,
       accessed as many times as counted below.
    5. Every access goes to HBM: no reuse from the cache, which is tens of MB while one layer's scores
       alone are far larger, and no recomputation.
    """),
    code(r"""
    show(*study.activations())
    """),
    md(r"""
    How often does the written-out attention touch its scores? Rather than guess, the count comes from
    PyTorch itself: the suite's own `CausalSelfAttention` runs forward and backward on a tiny input under a
    `TorchDispatchMode`, which sees every ATen operation PyTorch executes, the backward ones included, and
    counts the values of T×T shape each one reads and writes (views move no data and are skipped).
    `roofline.EAGER_SCORE_OPS` holds the result, and `tests/test_roofline.py` counts again on the installed
    torch, so the table below cannot drift from what PyTorch does. Eager mode on a GPU executes the same
    operations, one kernel each. The same counter run on the `flash` attention (SDPA) finds no T×T tensor
    at all: that is what FlashAttention changes.
    """),
    code(r"""
    show(*study.score_passes())
    """),
    md(r"""
    With `torch.compile` the written-out attention keeps its matrix products, but Inductor fuses the
    scale, the mask and the softmax into one kernel, and their backward into another. The count for that
    case is an assumption, not a measurement (compiling needs a C++ toolchain and far more time than
    this notebook takes): forward, the QKᵀ product writes the scores, one fused kernel reads them and
    writes the probabilities, AV reads those (4 passes); backward, a product writes the probabilities'
    gradient, the V gradient reads the probabilities, one fused kernel reads both and writes the scores'
    gradient, and the Q and K gradients read that (7 passes).

    The optimizer's traffic is counted by running it, the same way, on the tiny preset (bytes per
    parameter do not depend on the model's size; `tests/test_roofline.py` again). On a GPU,
    `torch.optim.AdamW`'s default implementation is `foreach` (a few multi-tensor kernels per step, each
    one pass over every parameter), so the count asks for it explicitly: on a CPU the default is a
    per-tensor loop doing the same arithmetic.
    """),
    code(r"""
    show(*study.optimizer_traffic())
    """),
    md(prose.paragraph(f"Now the two floors for every rung. The additions of each rung "
                       f"(`Utils.ladder.registry.RUNGS`) decide its inputs: {prose.floor_inputs()}.")),
    code(r"""
    show(*study.floor_table())
    """),
    md(r"""
    ### Overhead: how much work each launch carries

    PyTorch's eager mode runs one operation at a time: Python calls it, the dispatcher picks a kernel, the
    CPU launches it. That costs the CPU on the order of ten microseconds per operation, whatever the
    operation's size. While the GPU's kernels take longer than that, the CPU runs ahead and the cost is
    hidden; when they take less, the GPU waits and the step is overhead-bound. Counting the operations of
    one eager step (counted like the score passes; the count depends on the number of layers, not on the
    batch or the width) says how much GPU time each launch carries.
    """),
    code(r"""
    show(*study.overhead())
    """),
    md(r"""
    ### Which bound each rung sits against

    The conclusion for each rung, computed from the two floors and its measured median step time. The
    chart shows the same: the bar is the measured step, the marks the floors.
    """),
    code(r"""
    show(*study.bound_chart())
    """),
    md(r"""
    ### The measured split, where there is one

    The floors are estimates. A profile measures where the time goes: `make profile` writes
    `breakdown.csv` next to the results (`Utils.report.breakdown`: per rung, the milliseconds per step
    during which matrix-multiply and attention kernels run, only other kernels run, or the GPU idles). Set
    next to the floors, it says how close each class of kernels comes to its peak. Its `breakdown.md` also
    says where the GPU idles: the overhead's largest parts, each between the same two GPU activities every step.
    """),
    code(r"""
    show(*study.breakdown())
    """),
    md(r"""
    ## The ladder, one rung at a time

    Each rung is its predecessor plus one change (8-bit AdamW branches off the flash rung, in place of the
    fused optimizer). Every section prints the additions that differ from its predecessor, each with the
    registry's one-line description, and the lines of `Utils/` that make the change, straight from the
    code (the registry applies addition `name` with `Utils.ladder.apply.apply_<name>`). Then come the
    measured comparisons, from `Utils.report.walkthrough`.
    """),
    md(r"""
    ### baseline: FP32 everywhere, attention written out, eager, AdamW's default implementation

    **What it is.** The reference: every rung is compared with it. All arithmetic is FP32 and the FP32
    matrix multiplications run on the ordinary FP32 units, not the tensor cores. Attention computes the
    full T×T score matrix, masks it, applies softmax and multiplies by V, each step a separate kernel that
    writes its T×T result to memory. The model runs eagerly, one kernel per operation, and AdamW uses
    PyTorch's default multi-tensor (`foreach`) implementation. The training loop is the same for every rung;
    these are the lines where the additions enter it: `build` applies them stage by stage, and each step
    calls what they built.
    """),
    code(r"""
    show(walkthrough.change("baseline"),
         walkthrough.source("Utils/ladder/apply.py", "build", ("stage(", "GPT(", "adamw(", "_clip_and_step(")),
         walkthrough.source("Utils/train/loop.py", "make_step", ("autocast", "step_model(", "backward", "update()")),
         *study.effect("baseline"))
    """),
    md(prose.section("tf32")),
    code(r"""
    show(walkthrough.change("tf32"), *walkthrough.apply_sources("tf32"), *study.effect("tf32"), *study.tf32_share())
    """),
    md(prose.section("bf16")),
    code(r"""
    show(walkthrough.change("bf16"), *walkthrough.apply_sources("bf16"),
         walkthrough.source("Utils/ladder/apply.py", "Build.autocast"),
         walkthrough.source("Utils/train/loop.py", "make_step", ("autocast",)),
         *study.effect("bf16"), *study.bf16_gain())
    """),
    md(prose.section("torch_compile")),
    code(r"""
    show(walkthrough.change("torch_compile"), *walkthrough.apply_sources("torch_compile"),
         walkthrough.source(walkthrough.APPLY_SOURCE, "compile_with"),
         *study.effect("torch_compile"), *study.compile_break_even())
    """),
    md(prose.section("flash")),
    code(r"""
    show(walkthrough.change("flash"), *walkthrough.apply_sources("flash"),
         walkthrough.source("Utils/model.py", "CausalSelfAttention.forward"),
         *study.effect("flash"), *study.flash_memory())
    """),
    md(prose.section("fused")),
    code(r"""
    show(walkthrough.change("fused"), *walkthrough.apply_sources("fused"), *study.effect("fused"), *study.fused_bytes())
    """),
    md(prose.section("8bit")),
    code(r"""
    show(walkthrough.change("8bit"), *walkthrough.apply_sources("8bit"), *study.effect("8bit"), *study.eight_bit())
    """),
    md(prose.paragraphs(
        "### max: beyond the seven",
        f"**What changes.** The fused rung plus the further additions that measured faster or lighter on an H100 "
        f"or H200, did not slow the others down, and keep the model's mathematics (bf16 rounding aside, the "
        f"stochastic rounding of the bf16 parameters and states, and FP8's in the output layer, the two forward "
        f"GEMMs of `fp8_qkv_fc` and, in layers wider than {ADDITIONS['fp8_dgrad'].layers_wider_than[1]:,}, their "
        f"input gradients' GEMMs (`fp8_dgrad`)): "
        f"{prose.listing(MAX_ADDITIONS)}. `make ablation` "
        f"runs each addition alone on the fused rung, together with the ones that were tried and left out or "
        f"superseded: {prose.listing(a for a in ABLATION if a not in MAX_ADDITIONS)}.",
        f"**Why it can help.** Each addition removes a different cost: {prose.reasons(ABLATION)}.")),
    code(r"""
    show(walkthrough.change("max"), *walkthrough.apply_sources("max"), *study.effect("max"), *study.ablation(),
         *study.leave_one_out())
    """),
    md(r"""
    ## Did any rung change the learning?

    Every rung trains the same model on the same batches in the same order from the same seed, so the loss
    curves should lie on top of each other, up to rounding differences that grow over the steps. A rung
    whose loss drifts away from the baseline's by more than the batch-to-batch variation would be
    changing what is learned, not just how fast. A longer run says more than the last steps of a short one:
    the 300-step set is used when it exists.
    """),
    code(r"""
    show(*study.loss_drift(), *study.loss_set())
    """),
    md(r"""
    ## A larger batch

    Overhead is paid per step and compute and memory per token, so a larger batch dilutes the overhead:
    rungs that removed overhead gain less, rungs that removed traffic or FLOPs keep their gain. The batch-64
    set is compared here when it exists.
    """),
    code(r"""
    show(*study.batch64())
    """),
    md(r"""
    ## A small card: micro-batches

    On a card with 4 or 8 GB, a step of the whole batch does not fit: GPT-2 124M's fp32 weights, their
    gradients and AdamW's two states alone take 1.85 GiB (16 bytes a parameter) before any activation.
    Gradient accumulation keeps the optimizer's batch and splits the step: `MICRO_BATCH` rows go forward and
    backward at a time, each micro-batch's loss scaled by its share of the batch, the gradients adding up in
    place, and the optimizer steps once. The learning is the same (the tests check the gradients against the
    whole batch's); the speed is not. A micro-batch of a few rows makes small GEMMs, which keep few of the
    GPU's multiprocessors busy, and repeats every launch once per micro-batch, so overhead grows with the
    number of micro-batches. That is why a memory saving buys speed on a small card: no T×T scores (flash),
    8-bit optimizer states, a loss that never holds the whole logits (`max`) each can let a larger
    micro-batch fit. `MICRO_BATCH=auto` finds, for each rung, the largest divisor of `BATCH_SIZE` whose step
    fits, by running it; `GPU_MEMORY_GIB=x` caps the process at x GiB, so a large card shows what a small one
    fits (3.5 for a 4 GB card: the CUDA context takes about half a GiB outside the cap). Each set below is one
    device call; a column is a set's folder.
    """),
    code(r"""
    show(*study.small_cards())
    """),
    md(r"""
    Read down a column at batch 64 × 1,024 tokens, the same 65,536 tokens a step in every set: the smaller the
    card, the fewer rows a micro-batch, and the slower the same step. `fused` takes 141.4 ms in one micro-batch
    of 64 rows on the whole card, 139.3 in two of 32 (24 GB), 162.7 in eight of 8 (8 GB) and 436.6 in 32 of 2
    (4 GB). The whole batch's step does about 4.4 ms of work per 2,048 tokens; in micro-batches of 2 rows each
    one took 13.6 ms, since the host's share (Python, the compiled graph's guards, every kernel's launch) is paid
    32 times a step, and each kernel is too short to hide it. On the 4 GB card a memory saving is worth one step
    of micro-batch, at the margin: 8-bit AdamW's states are 0.7 GiB smaller than AdamW's, and at fe94fcb they let
    it fit 4 rows where `fused` fits 2, for a step (212.5 ms) twice as fast as `fused`'s. Measured again at
    2f16ee4, its 4-row try ran out of memory by about one micro-batch's logits, and it ran at 2 rows and
    `fused`'s speed: BENCHMARKS.md, "Small cards", has both calls. The three eager rungs fit not one row of
    1,024 tokens beside the 1.9 GiB of fp32 weights, gradients and AdamW's states; the run says so and names
    `SEQ_LEN=512`, which it tried, and which ran when followed. At 256 × 256 tokens, `torch_compile`'s search
    chose 8 rows that then ran out of memory in the run's second step: the run started again at 4, as its note
    says. The sets are from commit 2f16ee4 on one H100, the 24 GB one from fe94fcb on another; BENCHMARKS.md has
    the predictions written before each call.
    """),
    md(r"""
    ## The charts

    The figures `plot_results.py` writes next to the results, drawn here from the same report.
    """),
    code(r"""
    show(*study.charts())
    """),
    md(r"""
    ## A short guide

    **What to try first.**

    * **Any NVIDIA GPU from Ampere on (A100, H100, H200, RTX 30 and 40 series): BF16 autocast**, with TF32
      switched on for whatever stays FP32. It is a few lines, it halves activation memory, and it moves the
      matrix multiplications to the tensor cores at their fastest rate.
    * **Then FlashAttention** through `F.scaled_dot_product_attention`: one call in place of four lines,
      no accuracy cost, and the saving grows with the sequence length (the scores grow with its square).
    * **Then torch.compile**, once the code is stable and runs are long enough to repay the compile time:
      it turns chains of memory-bound operations into single kernels.
    * **Fused AdamW** is free: always switch it on where it is supported.
    * **8-bit AdamW** is for memory, not speed: use it when the optimizer states are what does not fit.

    **When an optimization does not pay.**

    * **Small models or small batches.** When each kernel takes less time than the CPU needs to launch it,
      the GPU waits on Python: faster kernels change nothing. Larger batches, `torch.compile` (fewer, larger
      kernels) and CUDA graphs (`mode="reduce-overhead"`, replaying a whole compiled graph with one launch) help there;
      precision does not.
    * **CPU-bound loops.** Data loading or tokenization in the training loop, `.item()` calls that
      synchronize every step, logging: the GPU idles whatever the kernels do. Profile before optimizing.
    * **GPUs without BF16 or TF32 (before Ampere: V100, T4).** TF32 does nothing there and BF16 is not
      supported; FP16 autocast with a gradient scaler takes BF16's place.
    * **Short runs with torch.compile**: compile time can exceed the time saved (see the break-even above).
    * **Steps that already sit against the compute floor at low precision**: from there only fewer FLOPs
      help (a smaller model, less recomputation), not more fusion.

    The measured ladder on this machine, rung by rung, in one line each:
    """),
    code(r"""
    show(*study.ladder_lines())
    """),
]


def build() -> nbformat.NotebookNode:
    """The notebook of CELLS, without outputs."""
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = dict(LANGUAGE_INFO)
    # Stable cell ids keep the committed file's diffs to what changed.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def kernel_config(folder: str):
    """Configuration for the kernel manager nbclient makes: its kernel talks over Unix domain sockets in `folder`.
    Over TCP (jupyter_client's default) ipykernel warns at start that the kernel is "running over TCP without
    encryption", since any local user can connect to its ports; sockets in a private folder are reachable by
    this user only, and the warning has no cause. Where libzmq has no IPC transport (Windows), TCP it is."""
    import zmq
    from traitlets.config import Config
    if not zmq.has("ipc"):
        return Config()
    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(folder, "kernel"),
                                     "connection_file": os.path.join(folder, "kernel.json")}})


def normalize(nb: nbformat.NotebookNode, stderr=sys.stderr) -> nbformat.NotebookNode:
    """Make an executed notebook a function of its cells and the results only: language_info back to the build's
    (the kernel writes its Python's exact version), adjacent stream outputs of one name merged (the kernel flushes
    them on a timer, so where one ends depends on timing), and stderr outputs (warnings of this machine's
    libraries) written to `stderr` instead of saved. Changes nb in place and returns it."""
    nb.metadata["language_info"] = dict(LANGUAGE_INFO)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        merged = []
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stderr":
                stderr.write(f"[cell {i}] {out.text}")
            elif out.output_type == "stream" and merged and merged[-1].output_type == "stream" \
                    and merged[-1].name == out.name:
                merged[-1].text += out.text
            else:
                merged.append(out)
        cell.outputs = merged
    return nb


def execute(nb: nbformat.NotebookNode, cwd: str = HERE, env: dict | None = None,
            timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell of `nb` in a fresh python3 kernel started in `cwd`, store the outputs in nb and normalize it.

    `env` is the kernel's whole environment (this process's when None): RESULTS there chooses the
    results folder. Raises nbclient.exceptions.CellExecutionError at the first cell that fails."""
    from nbclient import NotebookClient
    with tempfile.TemporaryDirectory(prefix="notebook-kernel-") as folder:
        client = NotebookClient(nb, timeout=timeout, kernel_name=KERNELSPEC["name"], record_timing=False,
                                resources={"metadata": {"path": cwd}}, config=kernel_config(folder))
        client.execute(env=dict(os.environ if env is None else env))
    return normalize(nb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build notebooks/Optimizing_GPU_Utilization.ipynb and execute "
                                                 "it against a results folder (saved with its outputs).")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    parser.add_argument("--results", help=f"results folder to read (default: $RESULTS, else {DEFAULT_RESULTS})")
    parser.add_argument("--output", help="where to write the notebook (default: the committed notebook for the "
                                          "default results, else the results folder)")
    args = parser.parse_args(argv)
    results = args.results or os.environ.get("RESULTS")
    if results and not args.no_execute:
        candidates = (results, os.path.join(REPO, results))
        found = next((p for p in candidates if os.path.isfile(os.path.join(p, "results.csv"))), None)
        if found is None:
            print(f"error: RESULTS={results} holds no results.csv: point it at a folder that make all wrote into",
                  file=sys.stderr)
            return 2
        args.results = found
    if args.output is None:   # another folder's notebook goes beside its results, not over the committed one
        folder = args.results or results
        other = folder and os.path.realpath(folder) != os.path.realpath(os.path.join(REPO, DEFAULT_RESULTS))
        args.output = os.path.join(folder, os.path.basename(NOTEBOOK)) if other else NOTEBOOK
    nb = build()
    if not args.no_execute:
        from nbclient.exceptions import CellExecutionError
        env = {**os.environ, "RESULTS": os.path.abspath(args.results)} if args.results else None
        try:
            execute(nb, env=env)
        except CellExecutionError as e:   # its message is the whole traceback, in colour: the error's last line
            failed = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                           and any(o.output_type == "error" for o in c.get("outputs", []))), "?")
            print(f"error: the notebook stopped at cell {failed} against {args.results or DEFAULT_RESULTS}: "
                  f"{e.ename}: {e.evalue}; {args.output} was not written", file=sys.stderr)
            return 1
    nbformat.validate(nb)
    try:
        nbformat.write(nb, args.output)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}" + ("" if args.no_execute else " with its outputs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
