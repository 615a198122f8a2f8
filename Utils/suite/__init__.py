"""The suite's driver, `python -m Utils.suite COMMAND [RUNG] [NAME=value ...] [--dry-run]`: what every make
target that trains, draws or removes results hands its variables to. It checks them once, in the order the
targets always have, and starts each run, chart and check as a process of its own through PYTHON, so that every
rung measures a fresh process and the driver itself never imports torch. `python -m Utils.suite --help` lists the
commands."""
