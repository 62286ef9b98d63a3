"""What torchrun tells each process it starts, read from the environment without torch.

A worker learns its place in the job from RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, and where
the ranks meet from MASTER_ADDR and MASTER_PORT. These are readable before any process group exists,
and by the commands that start ranks, which strip them from their children and never import torch.
"""

from __future__ import annotations

import os

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


def outside_any_job() -> dict[str, str]:
    """This process's environment without torchrun's variables: what a command passes to the ranks it
    starts, which must make a job of their own, not join the one this command may run in."""
    job = {*LAUNCH_VARIABLES, *RENDEZVOUS_VARIABLES}
    return {key: value for key, value in os.environ.items() if key not in job}


def env_rank() -> int:
    """Global rank; 0 for a plain ``python script.py``."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """Processes in the job; 1 for a plain ``python script.py``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_num_nodes() -> int:
    """Machines in the job: one torchrun (LOCAL_WORLD_SIZE workers) per node."""
    world_size = env_world_size()
    return max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))
