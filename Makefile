# The suite's one entry point. `make help` lists the targets and variables.
PYTHON ?= python3
# The rungs, their scripts and the additions come from the registry (Utils/ladder/registry.py).
LADDER := $(shell $(PYTHON) -m Utils.ladder rungs)
RUNGS := $(foreach p,$(LADDER),$(firstword $(subst :, ,$(p))))
ABLATION := $(shell $(PYTHON) -m Utils.ladder ablation)
LEAVE_ONE_OUT := $(shell $(PYTHON) -m Utils.ladder ablation max)
script = $(word 2,$(subst :, ,$(filter $(1):%,$(LADDER))))
ifeq ($(strip $(RUNGS)),)
$(error $(PYTHON) cannot read the registry (python -m Utils.ladder rungs): run make from the repository's root with Python 3.10+, or set PYTHON)
endif

, := ,
EXAMPLE := e.g. make fused STEPS=50 BATCH_SIZE=16 PREFIX=./out

# $(call sq,TEXT): TEXT quoted for the shell. $(call each_quoted,LIST): each word of LIST quoted on its own, so that a
# list a user typed (ADDITIONS, PEERS, NPROC) reaches its check as words, never as shell syntax: NPROC='1; rm x'
# is then refused by the check instead of run.
sq = '$(subst ','\'',$(1))'
each_quoted = $(foreach w,$(1),$(call sq,$(w)))
# $(call q,VAR): VAR's value exactly as the user typed it (make does not expand a $ in it), quoted for the
# shell, so that PREFIX='runs $$5' reaches the script as it was written. Make syntax in a value, $(shell ...),
# is make's to run, as on any make command line: make expands a variable given on its command line when it
# exports it to a recipe.
q = $(call sq,$(value $(1)))
# An optional variable is passed on when it is set at all, even to nothing, so that WARMUP= is refused
# by the script with a clear message instead of being silently dropped.
opt = $(if $(filter undefined,$(origin $(1))),,$(2)=$(call q,$(1)))
RUN_ARGS = --steps=$(call q,STEPS) --batch-size=$(call q,BATCH_SIZE) --prefix=$(call q,PREFIX) \
	$(call opt,MODEL,--model) $(call opt,SEQ_LEN,--seq-len) $(call opt,DEVICE,--device) \
	$(call opt,DATA,--data) $(call opt,WARMUP,--warmup) $(call opt,SEED,--seed) $(call opt,DATA_DIR,--data-dir) \
	$(call opt,SDPA_BACKEND,--sdpa-backend) $(call opt,MICRO_BATCH,--micro-batch) $(call opt,GPU_MEMORY_GIB,--gpu-memory-gib) \
	$(if $(filter 1 yes true,$(PROFILE)),--profile) $(if $(filter 1 yes true,$(COLD)),--cold)

need = @if [ -z $(call sq,$(strip $(value $(1)))) ]; then echo "error: $(1) is required ($(EXAMPLE))" >&2; exit 2; fi

.PHONY: help install lock check-upgrades all scaling ablation additions custom peers profile plots compare peak test gpu-test init_results reset clean notebook $(RUNGS) require-run require-prefix
.DEFAULT_GOAL := help

# A target that is none of these: name the rungs, rather than make's own "No rule to make target".
.DEFAULT:
	@printf "error: no target '%s': the rungs are $(RUNGS); make help lists the other targets\n" $(call sq,$@) >&2; exit 2

help:
	@echo "Train GPT-2 under a ladder of GPU optimizations and compare them."
	@echo ""
	@echo "  make <rung> STEPS=n BATCH_SIZE=b PREFIX=dir   run one rung: $(RUNGS)"
	@echo "                                                (REPEAT=n: n runs in a row, judged on their median)"
	@echo "  make all STEPS=n BATCH_SIZE=b PREFIX=dir      every rung in ladder order, then the charts"
	@echo "  make custom WITH=\"a b ...\" STEPS=n BATCH_SIZE=b PREFIX=dir   exactly those additions"
	@echo "  make scaling RUNG=r NPROC=\"1 2 4 8\" STEPS=n BATCH_SIZE=b PREFIX=dir   a rung at each GPU count, then scaling.png"
	@echo "  make additions                                the registry: every addition, its pillar and needs"
	@echo "  make ablation STEPS=n BATCH_SIZE=b PREFIX=dir the fused rung, then each addition tried for max alone on it"
	@echo "          FROM=max: the max rung, then max without each of its additions in turn"
	@echo "  make peers STEPS=n BATCH_SIZE=b PREFIX=dir    the trainers a user would pick instead ($(PEER_NAMES)), beside the rungs"
	@echo "                                                (RUNG=max REPEAT=3: max and the peers in 3 alternated rounds)"
	@echo "  make plots PREFIX=dir                         charts and summary.md from PREFIX/results.csv"
	@echo "  make compare PREFIXES=\"a b ...\" [OUT=dir]     one table and chart across results folders (compare.md/.png)"
	@echo "  make profile STEPS=n BATCH_SIZE=b PREFIX=dir  compute / memory / overhead split of every rung"
	@echo "  make init_results PREFIX=dir                  create PREFIX with empty results files"
	@echo "  make peak PREFIX=dir                          this machine's bf16 matmul and copy peaks, into PREFIX/peak.csv (MFU's second denominator)"
	@echo "  make clean PREFIX=dir                         remove the charts (scaling.png too), summary.md, breakdown.md/.png, compare.md/.png"
	@echo "  make reset PREFIX=dir                         remove every file the suite wrote in PREFIX, results too"
	@echo "  make notebook [RESULTS=dir]                   execute the notebook against RESULTS (saved into RESULTS)"
	@echo "  make install                                  what the suite needs, from the locks (PyTorch's CPU build where there is no GPU)"
	@echo "                                                (UPGRADE=1: the newest versions requirements.txt allows)"
	@echo "  make lock                                     resolve the locks again after a change to requirements*.txt"
	@echo "  make check-upgrades                           make test UPGRADE=1 in a new virtual environment"
	@echo "  make test                                     the test suite (CPU, about 13 minutes on 2 cores; installs requirements-test.lock)"
	@echo "  make gpu-test                                 the tests marked gpu, on a CUDA machine"
	@echo ""
	@echo "Optional: MODEL=auto|tiny|gpt2|gpt2-medium|gpt2-large|gpt2-xl  SEQ_LEN=n  DEVICE=auto|cuda|cpu"
	@echo "          MICRO_BATCH=auto|n (rows one forward/backward holds; the step accumulates BATCH_SIZE/n of them;"
	@echo "          auto: the largest divisor of BATCH_SIZE that fits, measured per rung)"
	@echo "          GPU_MEMORY_GIB=x (use at most x GiB of the GPU: what a smaller card would fit; 3.5 for a 4 GB card)"
	@echo "          DATA=auto|shakespeare|synthetic|path.txt  WARMUP=n  SEED=n  DATA_DIR=dir  PYTHON=python3"
	@echo "          REPEAT=n (rung targets, custom and all: n runs in a row, judged on their median; ablation: n rounds)"
	@echo "          PROFILE=1 (a rung target: profile it too)  ADDITIONS=\"a b c+d\" (make ablation: only these; c+d together)"
	@echo "          COLD=1 (compile with an empty Inductor cache, as on a fresh machine)"
	@echo "          SDPA_BACKEND=auto|flash|cudnn|efficient|math (the kernel SDPA is held to; auto: PyTorch's choice)"
	@echo "          NPROC=n (runs, all, custom, ablation: n processes through torchrun, one GPU each; BATCH_SIZE stays per GPU)"
	@echo "          PARALLEL=ddp|fsdp (with NPROC: DistributedDataParallel, the default, or FSDP2's fully_shard)"
	@echo "          PEERS=\"llmc hf\" (make peers: only these)  LLMC_SOURCE=dir|file.tar.gz (llm.c's source, offline)"

# The variables a user sets. A line break in one would end the recipe line that holds it, and the shell would
# see half a command: each is refused first, by name.
define newline


endef
USER_VARIABLES := STEPS BATCH_SIZE PREFIX MODEL SEQ_LEN DEVICE DATA WARMUP SEED DATA_DIR SDPA_BACKEND MICRO_BATCH \
	GPU_MEMORY_GIB UPGRADE PROFILE COLD REPEAT WITH \
	ADDITIONS FROM PEERS RUNG NPROC PARALLEL PREFIXES OUT RESULTS MATMUL_N COPY_GIB
broken_lines = $(strip $(foreach v,$(USER_VARIABLES),$(if $(findstring $(newline),$(value $(v))),$(v))))
no_line_breaks = @$(if $(broken_lines),echo 'error: $(firstword $(broken_lines)) holds a line break: give it on one line' >&2; exit 2,true)

require-run:
	$(no_line_breaks)
	$(call need,STEPS)
	$(call need,BATCH_SIZE)
	$(call need,PREFIX)
	@case $(call sq,$(COLD)) in ''|0|1|yes|no|true|false) ;; *) printf "error: COLD must be 1 (compile with an empty cache) or 0, not '%s'\n" $(call sq,$(COLD)) >&2; exit 2;; esac
	@case $(call sq,$(PROFILE)) in ''|0|1|yes|no|true|false) ;; *) printf "error: PROFILE must be 1 (profile the run too) or 0, not '%s'\n" $(call sq,$(PROFILE)) >&2; exit 2;; esac

require-prefix:
	$(no_line_breaks)
	$(call need,PREFIX)

# $(call not_empty,VAR,FIX): VAR given but set to nothing is refused with FIX, not read as its default (FROM= would
# otherwise run the whole ablation).
not_empty = @if [ '$(origin $(1))' = 'command line' ] || [ '$(origin $(1))' = environment ]; then \
	if [ -z $(call sq,$(strip $(value $(1)))) ]; then echo 'error: $(1) is empty: $(2)' >&2; exit 2; fi; fi

REPEAT ?= 1
# $(call rounds,ITEMS): ITEMS REPEAT times over, for `each`; $(call round_start,FIRST): in `each`'s command, a
# header as item FIRST begins each round after the first is counted (when REPEAT is above 1).
rounds = $$(r=0; while [ $$r -lt $(REPEAT) ]; do r=$$((r + 1)); echo $(1); done)
round_start = if [ $$x = $(1) ]; then round=$$(($${round:-0} + 1)); [ $(REPEAT) -eq 1 ] || echo "--- round $$round of $(REPEAT) ---"; fi
# true where RUNG names one rung
rung_named = [ $(words $(RUNG)) = 1 ] && [ -n "$(filter $(strip $(RUNG)),$(RUNGS))" ]
check_repeat = @case $(call sq,$(REPEAT)) in [1-9]|[1-9][0-9]) ;; *) printf "error: REPEAT must be a number of runs from 1 to 99, not '%s' (e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3)\n" $(call sq,$(REPEAT)) >&2; exit 2;; esac
# $(call repeat,NAME,COMMAND): COMMAND REPEAT times in a row, stopping at the first run that is not ok: on
# a GPU whose clock moves one run's median by a few percent, summary.md then reports the median of medians.
define repeat
	$(check_repeat)
	@printf '%s\n' $(call sq,$(strip $(2)))
	@run=0; while [ $$run -lt $(REPEAT) ]; do run=$$((run + 1)); \
		if [ $(REPEAT) -gt 1 ]; then echo "=== $(1), run $$run of $(REPEAT) ==="; fi; \
		$(call wait_for,$(2)); [ $$rc -eq 0 ] || exit $$rc; \
		$(call split_traces,exit $$?) \
	done
	$(redraw)
endef

# After a rung's or custom's runs into a PREFIX that holds a summary.md already (make plots, peers or all drew
# it), the summary and the charts are drawn again: left as they were, they would leave out the runs just
# appended. make all, scaling and profile draw once at their end, so their rungs skip it (DRAWN=1).
redraw = $(if $(DRAWN)$(filter 1 yes true,$(PROFILE)),,@if [ -f $(call q,PREFIX)/summary.md ]; then $(plot); fi)

# The charts after several runs; with PROFILE=1 none, since profiled runs are recorded in breakdown.md only.
# plot_results.py itself, not $(MAKE) plots, so that make -n peers runs nothing. make runs a recipe line
# that names $(MAKE) even under -n: in those (make all, make scaling), DRY_RUN makes the charts an echo
# (charts_beside_make). The test of MAKEFLAGS is the GNU make manual's ("Conditionals that Test Flags").
DRY_RUN := $(findstring n,$(firstword -$(MAKEFLAGS)))
plot = $(PYTHON) plot_results.py --prefix=$(call q,PREFIX)
charts = $(if $(filter 1 yes true,$(PROFILE)),echo "PROFILE=1: no charts (the profiled runs are in breakdown.md only)";,$(plot) || failed="$$failed plots";)
charts_beside_make = $(if $(DRY_RUN),echo $(plot);,$(charts))

# With PROFILE=1, the report splits the trace a run left into breakdown.csv, breakdown.md and breakdown.png:
# the training loop writes the trace only (Utils.report.breakdown).
# $(call split_traces,ON-FAILURE): that command, then ON-FAILURE if it fails; nothing without PROFILE=1.
split_traces = $(if $(filter 1 yes true,$(PROFILE)),$(PYTHON) -m Utils.report.breakdown --prefix=$(call q,PREFIX) || $(1);)

# $(call wait_for,COMMAND): COMMAND in the background, waited for, its status in $$rc; SIGTERM and SIGINT
# are passed on to it and it is waited for again: killed alone, the shell would return to make (and make
# to its caller) while the run is still writing its record.
wait_for = $(1) & pid=$$!; trap 'kill -TERM $$pid 2>/dev/null; wait $$pid; exit $$?' TERM INT; \
	wait $$pid; rc=$$?; trap - TERM INT

# NPROC processes through torchrun, one GPU each, where NPROC is above 1 or PARALLEL is named; otherwise one
# process, as always. $(call launch,SCRIPT-OR--m MODULE) is the command that starts a run.
NPROC ?= 1
distributed = $(or $(filter-out 1,$(strip $(NPROC))),$(strip $(PARALLEL)))
launch = $(if $(distributed),$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(call q,NPROC) $(1) \
	--parallel $(if $(strip $(PARALLEL)),$(call q,PARALLEL),ddp),$(PYTHON) $(1))
# $(call check_parallel,ADDITIONS): NPROC, PARALLEL, the additions and every other argument checked before
# any process starts (DATA=auto is fetched then, once, for all of them).
define check_parallel
	$(call not_empty,NPROC,use NPROC=1 (one process) or more$(,) or leave it out)
	$(call not_empty,PARALLEL,use PARALLEL=ddp or fsdp$(,) or leave it out (ddp))
	@$(if $(distributed),$(PYTHON) -m Utils.train.distributed check $(call q,NPROC) \
	$(call sq,$(or $(strip $(PARALLEL)),ddp)) $(call sq,$(or $(DEVICE),auto)) $(1) && \
	$(PYTHON) -m Utils.train.cli $(RUN_ARGS) >/dev/null,true)
endef

$(RUNGS): require-run
	$(call check_parallel,$@)
	$(call repeat,$@,$(call launch,$(call script,$@)) $(RUN_ARGS))

# Exactly the additions named in WITH (make additions lists them), recorded under a name built from them.
custom: require-run
	@if [ -z $(call sq,$(strip $(value WITH))) ]; then echo 'error: WITH is required: the additions to run, e.g. make custom WITH="bf16 torch_compile flash" STEPS=50 BATCH_SIZE=16 PREFIX=./out (make additions lists them)' >&2; exit 2; fi
	$(call check_parallel,$(call q,WITH))
	$(call repeat,custom,$(call launch,-m Utils.train) --with $(call q,WITH) $(RUN_ARGS))

additions:
	@$(PYTHON) -m Utils.ladder table

# $(call each,NAME,ITEMS,COMMAND,AFTER): COMMAND for every item (as $$x), going on past failures; then
# AFTER; then exits non-zero naming what was not ok. Arguments are checked once, before the first item (under
# make -n only checked: no PREFIX made, no data fetched).
define each
	@data=$$($(PYTHON) -m Utils.train.cli $(if $(DRY_RUN),--dry-run) $(RUN_ARGS)) || exit $$?; \
	failed=""; \
	for x in $(2); do \
		echo "=== $(1) $$x ==="; \
		$(call wait_for,$(3)); [ $$rc -eq 0 ] || failed="$$failed $$x"; \
	done; \
	$(4) \
	failed=$$(printf '%s\n' $$failed | awk 'NF && !seen[$$0]++ { printf " %s", $$0 }'); \
	if [ -n "$$failed" ]; then echo "error: make $(1): not ok:$$failed (see "$(call q,PREFIX)")" >&2; exit 1; fi
endef

# RUNG at each process count in NPROC (through torchrun, PARALLEL=ddp unless named), then the charts: scaling.png.
scaling: require-run
	$(check_repeat)
	@if ! { $(rung_named); }; then echo 'error: RUNG must name one rung ($(RUNGS)), e.g. make scaling RUNG=max NPROC="1 2" STEPS=60 BATCH_SIZE=16 PREFIX=./out' >&2; exit 2; fi
	@if [ -z $(call sq,$(strip $(NPROC))) ]; then echo 'error: NPROC is required: the GPU counts to run, e.g. NPROC="1 2 4 8"' >&2; exit 2; fi
	@for n in $(call each_quoted,$(NPROC)); do $(PYTHON) -m Utils.train.distributed check "$$n" $(call sq,$(or $(strip $(PARALLEL)),ddp)) $(call sq,$(or $(DEVICE),auto)) $(RUNG) || exit $$?; done
	$(call each,scaling,$(NPROC),$(MAKE) --no-print-directory $(RUNG) DRAWN=1 NPROC=$$x PARALLEL=$(call sq,$(or $(strip $(PARALLEL)),ddp)) $${data:+DATA=$$data},$(charts_beside_make))

all: require-run
	$(check_repeat)
	$(call check_parallel,)
	$(call each,all,$(RUNGS),$(MAKE) --no-print-directory $$x DRAWN=1 $${data:+DATA=$$data},$(charts_beside_make))

# Each addition tried for the max rung alone on top of the fused rung, as rungs fused+<addition>, after a
# run of the fused rung itself: every "vs fused" then divides runs of one commit on one machine, back to
# back. FROM=max: the max rung, then max without each of its additions beyond the fused rung in turn, as
# max-<addition>. REPEAT=n: n such rounds, so that each pair is measured n times, alternated, across the
# same stretch of the GPU's clock and power; summary.md gives each row the median of its runs. Then the charts.
# Additions joined by '+' in ADDITIONS are tried together: ADDITIONS="bf16_residual+combo_kernels" FROM=max
# runs max-bf16_residual-combo_kernels, max without both.
ABLATION_FROM = $(or $(strip $(FROM)),fused)
ABLATION_TRIES = $(if $(filter max,$(ABLATION_FROM)),$(LEAVE_ONE_OUT),$(ABLATION))
ABLATION_ROUND = $(ABLATION_FROM) $(if $(ADDITIONS),$(ADDITIONS),$(ABLATION_TRIES))
ablation: require-run
	$(check_repeat)
	$(call not_empty,FROM,use FROM=fused or FROM=max$(,) or leave it out (fused))
	$(call not_empty,ADDITIONS,name the additions to try (make additions lists them)$(,) or leave ADDITIONS out to try every one)
	@$(PYTHON) -m Utils.ladder check-ablation $(call sq,$(ABLATION_FROM)) $(call each_quoted,$(ADDITIONS))
	$(call check_parallel,$(call sq,$(ABLATION_FROM)))
	$(call each,ablation,$(call rounds,$(ABLATION_ROUND)),$(call round_start,$(ABLATION_FROM)); if [ $$x = $(ABLATION_FROM) ]; then run='$(call script,$(ABLATION_FROM))'; else run="ablation.py $(if $(filter max,$(ABLATION_FROM)),--drop,--add) $$x"; fi; $(call launch,$$run) $(RUN_ARGS) $${data:+--data=$$data},$(call split_traces,failed="$$failed profile") $(charts))

# The peers (Utils/peers): llm.c built from source, and Hugging Face's GPT-2, recorded as peer-<name>.
# RUNG=<rung>: that rung first, then each peer; REPEAT=n: n such rounds, so that the rung and the peers it is
# divided by are measured alternated, across the same stretch of the GPU's clock and power.
PEER_NAMES := $(shell $(PYTHON) -c "from Utils.peers import PEERS; print(*PEERS)")
PEERS ?= $(PEER_NAMES)
PEER_ROUND = $(strip $(RUNG) $(PEERS))
export LLMC_SOURCE
peers: require-run
	$(check_repeat)
	@if [ -z $(call sq,$(strip $(PEERS))) ]; then echo "error: PEERS is empty: name some of $(PEER_NAMES)" >&2; exit 2; fi
	@if [ $(call sq,$(strip $(NPROC))) != 1 ] || [ -n $(call sq,$(strip $(PARALLEL))$(filter 1 yes true,$(PROFILE))) ]; then echo "error: make peers runs each peer as one process, unprofiled: leave out NPROC, PARALLEL and PROFILE" >&2; exit 2; fi
	@seen=" "; for x in $(call each_quoted,$(PEERS)); do case " $(PEER_NAMES) " in *" $$x "*) ;; *) echo "error: PEERS names $$x: use some of $(PEER_NAMES)" >&2; exit 2;; esac; \
		case "$$seen" in *" $$x "*) echo "error: PEERS names $$x twice: name each peer once (REPEAT=n runs rounds)" >&2; exit 2;; esac; seen="$$seen$$x "; done
	@if [ -n $(call sq,$(strip $(RUNG))) ] && ! { $(rung_named); }; then echo 'error: RUNG must name one rung ($(RUNGS)) to run beside the peers, e.g. make peers RUNG=max REPEAT=3 STEPS=30 BATCH_SIZE=64 PREFIX=./out' >&2; exit 2; fi
	$(call each,peers,$(call rounds,$(PEER_ROUND)),$(call round_start,$(firstword $(PEER_ROUND))); if [ $$x = '$(strip $(RUNG))' ]; then run='$(call script,$(strip $(RUNG)))'; else run="-m Utils.peers $$x"; fi; $(PYTHON) $$run $(RUN_ARGS) $${data:+--data=$$data},$(charts))

# Each rung again with --profile: STEPS timed steps, then a few under torch.profiler; writes the
# breakdown files and a trace per rung, and leaves results.csv alone.
profile: require-run
	$(check_repeat)
	$(call check_parallel,)
	$(call each,profile,$(RUNGS),$(MAKE) --no-print-directory $$x DRAWN=1 PROFILE=1 $${data:+DATA=$$data})

plots: require-prefix
	$(plot)

# One table and one chart across results folders (machines or commits), written into OUT (default: the first).
# Each word of PREFIXES is one folder, quoted for the shell as $(call q,...) quotes PREFIX.
compare:
	@if [ -z $(call sq,$(strip $(value PREFIXES))) ]; then echo 'error: PREFIXES is required: two or more results folders, e.g. make compare PREFIXES="results/h200-b16 results/h100-b16" [OUT=dir]' >&2; exit 2; fi
	$(PYTHON) -m Utils.report.compare $(call opt,OUT,--out) -- $(call each_quoted,$(value PREFIXES))

init_results: require-prefix
	$(PYTHON) -m Utils.results.store init $(call q,PREFIX)

# This machine's bf16 matmul rate and copy bandwidth, a row appended to PREFIX/peak.csv: MFU's second
# denominator. MATMUL_N and COPY_GIB override the sizes (default 8192 and 2 GiB on a GPU).
peak: require-prefix
	$(PYTHON) -m Utils.train.peak --prefix=$(call q,PREFIX) $(call opt,DEVICE,--device) $(call opt,MATMUL_N,--matmul-n) $(call opt,COPY_GIB,--copy-gib)

# Only the files the suite writes, by name: anything else in PREFIX is left alone.
CHARTS := speedup.png step_time.png throughput.png memory.png loss.png summary.md \
	breakdown.md breakdown.png compare.md compare.png scaling.png
# $(call remove,FILES): remove FILES from PREFIX; a PREFIX that does not exist has nothing to remove, one
# that is not a folder or whose files cannot be removed is an error, naming it.
define remove
	@if [ ! -e $(call q,PREFIX) ]; then echo "PREFIX="$(call q,PREFIX)" does not exist: nothing to remove"; exit 0; fi; \
	if [ ! -d $(call q,PREFIX) ]; then echo "error: PREFIX="$(call q,PREFIX)" is not a folder" >&2; exit 2; fi; \
	cd $(call q,PREFIX) && rm -fv $(1) || { echo "error: cannot remove the suite's files in PREFIX="$(call q,PREFIX)" (see above)" >&2; exit 1; }
endef
clean: require-prefix
	$(call remove,$(CHARTS) .tmp-*)

reset: require-prefix
	$(call remove,$(CHARTS) results.csv runs.csv breakdown.csv peak.csv trace_*.json.gz *.error.log [0-9]*-peer-*.log Optimizing_GPU_Utilization.ipynb .results.lock .tmp-* .rank-failure-*)

# Re-executes the notebook against RESULTS, saving its outputs: in place for the default results/h200-b16,
# else into RESULTS/Optimizing_GPU_Utilization.ipynb (the committed file stays as it is). The file depends on
# the cells and the results only, so a second run against the same results changes nothing.
notebook:
	@$(PYTHON) -c "import nbformat, nbclient, ipykernel" 2>/dev/null || \
		PIP_DISABLE_PIP_VERSION_CHECK=1 $(PYTHON) -m Utils.install notebook$(upgrade)
	$(PYTHON) notebooks/build_notebook.py $(if $(RESULTS),--results=$(call q,RESULTS))

# Installs come from the locks (requirements*.lock: exact versions with hashes); UPGRADE=1 takes the newest
# versions requirements*.txt allow instead. A CUDA build of PyTorch where nvidia-smi finds a GPU, its CPU build
# elsewhere (TORCH_CPU_INDEX= names a mirror of PyTorch's CPU index). Utils/install.py says how.
upgrade = $(if $(filter 1 yes true,$(UPGRADE)), --upgrade)
export TORCH_CPU_INDEX
install:
	$(PYTHON) -m Utils.install suite$(upgrade)

# Every lock resolved again from requirements*.txt (uv pip compile); commit the locks with the change.
lock:
	$(PYTHON) -m Utils.install lock

PYTEST = -m pytest -q -rs -n auto --dist loadgroup tests
test:
	@PIP_DISABLE_PIP_VERSION_CHECK=1 $(PYTHON) -m Utils.install test$(upgrade)
	$(PYTHON) $(PYTEST)

# What CI would meet with the newest releases: make test UPGRADE=1 in a new virtual environment, made in a
# temporary folder and removed after; run it before a release breaks CI, as it did with pytest 9.2.
check-upgrades:
	@venv=$$(mktemp -d); trap 'rm -rf "$$venv"' EXIT; $(PYTHON) -m venv "$$venv" && \
	PIP_DISABLE_PIP_VERSION_CHECK=1 "$$venv/bin/python" -m Utils.install test --upgrade && \
	"$$venv/bin/python" $(PYTEST)

# The tests that need a CUDA GPU (marked gpu); `make test` leaves them out. Only the files that hold such
# tests are collected, so that a GPU machine needs none of the notebook's packages.
gpu-test:
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: make gpu-test needs a CUDA GPU that PyTorch sees; make test runs the rest')"
	$(PYTHON) -m pytest -q -rs --durations=10 -m gpu $$(grep -l "mark.gpu" tests/test_*.py)
