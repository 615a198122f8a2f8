# The suite's one entry point: every target that trains, draws or tidies results hands its variables to the
# driver, python -m Utils.suite (Utils/suite/), which checks them once and runs the target. `make help` lists the
# targets and variables; `python -m Utils.suite --help` the same commands without make.
PYTHON ?= python3
# The rungs come from the registry (Utils/ladder/registry.py); none means that PYTHON cannot read it.
RUNGS := $(foreach p,$(shell $(PYTHON) -m Utils.ladder rungs),$(firstword $(subst :, ,$(p))))
ifeq ($(strip $(RUNGS)),)
$(error $(PYTHON) cannot read the registry (python -m Utils.ladder rungs): run make from the repository's root with Python 3.10+, or set PYTHON)
endif

# The variables a user sets (Utils/suite/given.py reads the same list). Each one set on the command line or in the
# environment reaches the driver as one word NAME=value, exactly as typed: quoted for the shell and read with
# $(value ...), so that make expands no $ in it (PREFIX='runs $$5'). One left out is not passed, so that the driver
# tells FROM= (set to nothing: refused) from no FROM (its default).
USER_VARIABLES := STEPS BATCH_SIZE PREFIX MODEL SEQ_LEN DEVICE DATA WARMUP SEED DATA_DIR SDPA_BACKEND MICRO_BATCH \
	GPU_MEMORY_GIB UPGRADE PROFILE COLD REPEAT WITH \
	ADDITIONS FROM PEERS RUNG NPROC PARALLEL NNODES NODE_RANK RDZV_ENDPOINT RDZV_ID RDZV_TIMEOUT PREFIXES OUT RESULTS \
	MATMUL_N COPY_GIB
sq = '$(subst ','\'',$(1))'
given = $(foreach v,$(USER_VARIABLES),$(if $(filter command environment,$(firstword $(origin $(v)))),$(call sq,$(v)=$(value $(v)))))
# A line break in a value would end the recipe line that holds it before the driver could see it: refused here.
define newline


endef
broken = $(firstword $(foreach v,$(USER_VARIABLES),$(if $(findstring $(newline),$(value $(v))),$(v))))
# make -n (and -t, -q, which also run the lines marked +): the driver checks and prints, and runs nothing.
flags := $(firstword -$(MAKEFLAGS))
DRY_RUN := $(findstring n,$(flags))$(findstring t,$(flags))$(findstring q,$(flags))
# $(call suite,COMMAND): the driver as the recipe's one process (exec), so that a signal to make reaches it.
suite = $(if $(broken),echo 'error: $(broken) holds a line break: give it on one line' >&2; exit 2,exec $(PYTHON) -m Utils.suite $(1) $(call sq,PYTHON=$(PYTHON)) $(given)$(if $(DRY_RUN), --dry-run))

.PHONY: help install lock check-upgrades all scaling ablation additions custom peers profile plots compare peak test \
	gpu-test init_results reset clean notebook $(RUNGS)
.DEFAULT_GOAL := help

help additions:
	@$(call suite,$@)

# A target that is none of these: the driver names the rungs, rather than make's own "No rule to make target".
.DEFAULT:
	@$(call suite,unknown $(call sq,$@))

# The targets that train: checked once, then run, each run a process of its own; under make -n checked and
# printed only (+: make runs the line even then, and the driver is told --dry-run).
$(RUNGS):
	+@$(call suite,run $@)
all custom scaling ablation peers profile:
	+@$(call suite,$@)

plots compare init_results peak clean reset:
	@$(call suite,$@)

# Re-executes the notebook against RESULTS, saving its outputs: in place for the default results/h200-b16,
# else into RESULTS/Optimizing_GPU_Utilization.ipynb. Installs its packages first where they are missing.
upgrade = $(if $(filter 1 yes true,$(UPGRADE)), --upgrade)
notebook:
	@$(PYTHON) -c "import nbformat, nbclient, ipykernel" 2>/dev/null || \
		PIP_DISABLE_PIP_VERSION_CHECK=1 $(PYTHON) -m Utils.install notebook$(upgrade)
	$(PYTHON) notebooks/build_notebook.py $(if $(RESULTS),--results=$(call sq,$(value RESULTS)))

# Installs come from the locks (requirements*.lock); UPGRADE=1 takes the newest versions requirements*.txt allow.
# Utils/install.py says how (TORCH_CPU_INDEX= names a mirror of PyTorch's CPU index). These need no driver: they
# run before the suite's packages are installed.
export TORCH_CPU_INDEX LLMC_SOURCE
install:
	$(PYTHON) -m Utils.install suite$(upgrade)

lock:
	$(PYTHON) -m Utils.install lock

PYTEST = -m pytest -q -rs -n auto tests
test:
	@PIP_DISABLE_PIP_VERSION_CHECK=1 $(PYTHON) -m Utils.install test$(upgrade)
	$(PYTHON) $(PYTEST)

# make test UPGRADE=1 in a new virtual environment, removed after: what CI would meet with the newest releases.
check-upgrades:
	@venv=$$(mktemp -d); trap 'rm -rf "$$venv"' EXIT; $(PYTHON) -m venv "$$venv" && \
	PIP_DISABLE_PIP_VERSION_CHECK=1 "$$venv/bin/python" -m Utils.install test --upgrade && \
	"$$venv/bin/python" $(PYTEST)

# The tests marked gpu, on a CUDA machine; only the files that hold them are collected, so that a GPU machine
# needs none of the notebook's packages.
gpu-test:
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: make gpu-test needs a CUDA GPU that PyTorch sees; make test runs the rest')"
	$(PYTHON) -m pytest -q -rs --durations=10 -m gpu $$(grep -l "mark.gpu" tests/test_*.py)
