"""The results contract: what a run leaves in PREFIX, and how it is written and read back. No torch here.

    schema   the files, their columns (which are numeric, which version added them), the statuses, which
             runs compare: defined once
    store    whole-or-absent appends under a lock; earlier versions' files widened, foreign or damaged refused
    read     the files back as pandas frames (load, load_peak)
    files    whole-or-absent writes of any file (write_atomic)
    metrics  FLOPs per token, MFU, median and IQR
    gpus     the one table of GPU peaks (bf16, tf32, fp32 FLOP/s, memory bandwidth) with their sources
"""
