"""From results files to what a reader sees: charts, summary.md and the breakdown report. No torch here, so
that `make plots` runs where torch cannot be imported.

    selection  which runs a ladder report compares, and why the others are left out
    stats      the numbers: medians, IQRs, speedups with bootstrap intervals, notes, captions (Report)
    charts     speedup.png, step_time.png, throughput.png, memory.png, loss.png
    scaling    one rung across GPU counts: global tokens/s, scaling efficiency, scaling.png
    compare    several results folders (machines, commits) side by side: compare.md, compare.png
    ablation   each addition against the rung it joined or left (make ablation), for summary.md and the notebook
    loss       the loss with each addition and without it at each seed, against the seeds' gap (summary.md)
    summary    summary.md
    cli        plot_results.py's command line
    figures    what every chart shares: resolution, wrapped titles and footnotes, writing
    markdown   the Markdown tables of summary.md and breakdown.md
    breakdown  the compute / memory / overhead split of profiled steps, and its report
    roofline   the least time a step's compute and memory traffic allow
    walkthrough  the notebook's analysis
    notebook_prose  the notebook's text on each addition, from the registry
"""
