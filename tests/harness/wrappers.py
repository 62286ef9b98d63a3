"""The programs a test puts between the launcher and the script, by the path a command line gives them.

Each runs the script it is given with ``runpy``, as ``python script.py`` would, after changing one
thing about the run; a test passes ``[WRAPPER, ARG]`` as ``run_script``'s ``wrapper``, and the Slurm
tests put ``PAUSE_ONCE`` before the script in a job's arguments. The paths are relative to the
repository root: the folder every run starts in, and what a Slurm test's checkout links.
"""

HARNESS = "tests/harness"
# Rank 1 raises, is killed (once), gets a NaN loss or an infinite weight at a step, or is killed in
# the middle of a save; or rank 0 fills the run directory's disk.
INJECT_FAULT = f"{HARNESS}/inject_fault.py"
# Writes down what happens inside the steps: reads of device values, the gradients' dtypes, the
# memory a model takes to build, the private memory at a step's start.
OBSERVE = f"{HARNESS}/observe.py"
# The per-image MNIST pipeline instead of the batched one on the device.
PER_IMAGE_MNIST = f"{HARNESS}/per_image_mnist.py"
# Holds the trainers still (SIGSTOP) after step 5, once per run directory, for a test to act on.
PAUSE_ONCE = f"{HARNESS}/pause_once.py"
# Not a wrapper but a program of its own: rounds of gloo process groups set up and torn down.
TEARDOWN_ROUNDS = f"{HARNESS}/teardown_rounds.py"
# Writes down every example the training loader reads, by which rank and generation of the job.
RECORD_READS = f"{HARNESS}/record_reads.py"
# Not a wrapper but a program of its own: two ranks reach an agreement of common.distributed, one of them late.
LATE_AGREEMENT = f"{HARNESS}/late_agreement.py"
