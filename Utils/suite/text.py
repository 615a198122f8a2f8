"""What `make help` prints: every target and variable a user types."""
from Utils.ladder.registry import RUNGS
from Utils.peers import PEERS

HELP = """Train GPT-2 under a ladder of GPU optimizations and compare them.

  make <rung> STEPS=n BATCH_SIZE=b PREFIX=dir   run one rung: {rungs}
                                                (REPEAT=n: n runs in a row, judged on their median)
  make all STEPS=n BATCH_SIZE=b PREFIX=dir      every rung in ladder order, then the charts
  make custom WITH="a b ..." STEPS=n BATCH_SIZE=b PREFIX=dir   exactly those additions
  make scaling RUNG=r NPROC="1 2 4 8" STEPS=n BATCH_SIZE=b PREFIX=dir   a rung at each GPU count, then scaling.png
  make additions                                the registry: every addition, its pillar and needs
  make ablation STEPS=n BATCH_SIZE=b PREFIX=dir the fused rung, then each addition tried for max alone on it
          FROM=max: the max rung, then max without each of its additions in turn
  make peers STEPS=n BATCH_SIZE=b PREFIX=dir    the trainers a user would pick instead ({peers}), into PREFIX
                                                (RUNG=max REPEAT=3: max and the peers in 3 alternated rounds)
  make plots PREFIX=dir                         charts and summary.md from PREFIX/results.csv
  make compare PREFIXES="a b ..." [OUT=dir]     one table and chart across results folders (compare.md/.png)
  make profile STEPS=n BATCH_SIZE=b PREFIX=dir  compute / memory / overhead split of every rung
  make init_results PREFIX=dir                  create PREFIX with empty results files
  make peak PREFIX=dir                          this machine's bf16 matmul and copy peaks, into PREFIX/peak.csv (MFU's second denominator)
                                                (MATMUL_N=n: the square matmul's side; COPY_GIB=g: GiB copied)
  make clean PREFIX=dir                         remove the charts (scaling.png too), summary.md, breakdown.md/.png, compare.md/.png
  make reset PREFIX=dir                         remove every file the suite wrote in PREFIX, results too
  make notebook [RESULTS=dir]                   execute the notebook against RESULTS (saved into RESULTS)
  make install                                  what the suite needs, from the locks (PyTorch's CPU build where there is no GPU)
                                                (UPGRADE=1: the newest versions requirements.txt allows;
                                                TORCH_CPU_INDEX=url: a mirror of PyTorch's CPU index)
  make lock                                     resolve the locks again after a change to requirements*.txt
  make check-upgrades                           make test UPGRADE=1 in a new virtual environment
  make test                                     the test suite (CPU, about 11 minutes on 2 cores; installs requirements-test.lock)
  make gpu-test                                 the tests marked gpu, on a CUDA machine

Optional: MODEL=auto|tiny|gpt2|gpt2-medium|gpt2-large|gpt2-xl  SEQ_LEN=n  DEVICE=auto|cuda|cpu
          MICRO_BATCH=auto|n (rows one forward/backward holds; the step accumulates BATCH_SIZE/n of them;
          auto: the largest divisor of BATCH_SIZE that fits, measured per rung)
          GPU_MEMORY_GIB=x (use at most x GiB of the GPU: what a smaller card would fit; 3.5 for a 4 GB card)
          DATA=auto|shakespeare|synthetic|path.txt  WARMUP=n  SEED=n  DATA_DIR=dir  PYTHON=python3
          REPEAT=n (rung targets, custom and all: n runs in a row, judged on their median; ablation: n rounds)
          PROFILE=1 (a rung target: profile it too)  ADDITIONS="a b c+d" (make ablation: only these; c+d together)
          COLD=1 (compile with an empty Inductor cache, as on a fresh machine)
          SDPA_BACKEND=auto|flash|cudnn|efficient|math (the kernel SDPA is held to; auto: PyTorch's choice)
          NPROC=n (runs, all, custom, ablation: n processes through torchrun, one GPU each; BATCH_SIZE stays per GPU)
          PARALLEL=ddp|fsdp (with NPROC: DistributedDataParallel, the default, or FSDP2's fully_shard)
          NNODES=n NODE_RANK=i RDZV_ENDPOINT=host:port (several hosts: the same command on each, i from 0 on the host
          of RDZV_ENDPOINT; RDZV_ID=word, the same on each; RDZV_TIMEOUT=s a node waits for the others, 300)
          PEERS="llmc hf" (make peers: only these)  LLMC_SOURCE=dir|file.tar.gz (llm.c's source, offline)

Without make: python -m Utils.suite COMMAND [RUNG] [NAME=value ...] [--dry-run], the same commands and variables
(python -m Utils.suite --help)."""


def help_text() -> str:
    return HELP.format(rungs=" ".join(RUNGS), peers=" ".join(PEERS))


def unknown_target(name: str) -> str:
    return f"no target '{name}': the rungs are {' '.join(RUNGS)}; make help lists the other targets"
