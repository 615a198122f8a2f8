"""A run's record: its row of runs.csv as typed fields, filled in as the run goes and written once at its end.

A misspelt field is an error where it is set (the record declares its fields, with slots), not a blank cell
found later in the report; row() names exactly the schema's run columns (Utils.results.schema), in its order.
"""
from dataclasses import dataclass, field, fields

from Utils.results.schema import RUN_COLUMNS, SCHEMA_VERSION
from Utils.train.nvml import Clocks
from Utils.train.provenance import Provenance

# Fields that are not columns themselves: two records of their own, whose columns the row takes, and the rank.
_NOT_COLUMNS = ("provenance", "clocks", "rank")
_BLANK_PROVENANCE = dict.fromkeys(f.name for f in fields(Provenance))


@dataclass(slots=True, kw_only=True)
class Run:
    """One run as runs.csv records it, its fields in the schema's order (their meanings there). A figure stays
    None, a blank cell, until the run measures it: a run that fails early is recorded with what it has."""
    run_id: str
    optimization: str
    status: str = ""                   # one of schema.STATUSES once the run has ended
    message: str = ""
    started_at: str
    steps: int
    warmup_steps: int
    batch_size: int
    seq_len: int
    model: str
    n_params: int | None = None
    data: str
    compile_s: float | None = None
    peak_mem_allocated_gib: float | None = None
    peak_mem_reserved_gib: float | None = None
    median_step_ms: float | None = None
    iqr_step_ms: float | None = None
    median_tokens_per_s: float | None = None
    mfu: float | None = None
    final_loss: float | None = None
    notes: str = ""
    command: str
    config: str                        # JSON
    schema_version: int = field(default=SCHEMA_VERSION, init=False)   # the store writes its own version
    window_wall_s: float | None = None
    flops_per_token: int | None = None
    compile_cache: str | None = None
    nproc: int = 1
    parallel: str = ""
    global_tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    attention_kernel: str | None = None
    micro_batch: int | None = None
    accumulation_steps: int | None = None
    gpu_memory_gib: float | None = None
    nnodes: int = 1
    hosts: str = ""
    # None until known: a peer in a program of its own is described after it ran, with no CUDA context beside it
    provenance: Provenance | None = None
    clocks: Clocks = field(default_factory=Clocks)
    rank: int = 0                      # the process holding the record: rank 0's is written

    def row(self) -> dict[str, object]:
        """runs.csv's row: every run column of the schema, in its order; None for a blank cell."""
        cells = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_COLUMNS}
        cells.update(self.provenance.columns() if self.provenance else _BLANK_PROVENANCE)
        cells.update(self.clocks.columns())
        return {name: cells[name] for name in RUN_COLUMNS}
