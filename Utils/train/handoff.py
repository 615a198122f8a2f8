"""What the driver (Utils.suite) tells a run through the environment of the process it starts. Imports nothing:
the driver, which holds no CUDA context while a rung measures, reads its names from here."""

# The driver's word for a run whose processes never started, set in the environment of one process it starts in
# their place, without torchrun: JSON {"nnodes": n, "nproc": n, "parallel": mode, "message": why}. The run is
# recorded failed with it and nothing is trained (a node that never joined the rendezvous leaves torchrun nothing
# to start: Utils.suite.targets).
NOT_STARTED = "GPT_SUITE_NOT_STARTED"
