"""Where a step's time goes: compute, memory traffic and overhead, measured in the Chrome traces torch.profiler
exports.

    kernels   the classes of a step's time, and which kernels belong to which (KERNEL_CLASSES)
    trace     a Chrome trace's profiled steps split into those classes (load_trace, split -> Breakdown)
    files     the traces, breakdown.csv and kernels.csv (add_traces) and breakdown.md / breakdown.png in PREFIX
              (write_report)
    render    breakdown.md's text
    chart     breakdown.png

The names the notebook and the tests use are importable from here; `python -m Utils.report.breakdown
--prefix DIR` splits a folder's new traces (make runs it after a profiled run).
"""
from Utils.report.breakdown.chart import plot_breakdown
from Utils.report.breakdown.files import (CHART_FILE, REPORT_FILE, add_traces, append_breakdown_csv,
                                          append_kernels_csv, load_breakdown, trace_path, write_report)
from Utils.report.breakdown.kernels import (COMPUTE, CPU_CLASSES, CPU_OPS, GPU_CLASSES, KERNEL_CLASSES, MEMORY,
                                            OVERHEAD, UNKNOWN, classify, kernel_id, short_name)
from Utils.report.breakdown.render import render_report
from Utils.report.breakdown.trace import (STEP_END, STEP_START, Breakdown, Gap, KernelStat, TraceError, Transfer,
                                          load_trace, split)

__all__ = ["CHART_FILE", "COMPUTE", "CPU_CLASSES", "CPU_OPS", "GPU_CLASSES", "KERNEL_CLASSES", "MEMORY", "OVERHEAD",
           "REPORT_FILE", "STEP_END", "STEP_START", "UNKNOWN", "Breakdown", "Gap", "KernelStat", "TraceError",
           "Transfer", "add_traces", "append_breakdown_csv", "append_kernels_csv", "classify", "kernel_id",
           "load_breakdown", "load_trace", "plot_breakdown", "render_report", "short_name", "split", "trace_path",
           "write_report"]
