"""Start and tear down a gloo process group many times in one process, as every training run does once.

    torchrun --standalone --nproc_per_node=3 tests/harness/teardown_rounds.py --rounds 200

Each round ends like a training run: small collectives on tensors that Python
drops at once (the final record's), then common.distributed.teardown_distributed.
On torch 2.6 and 2.7 a plain destroy_process_group() deadlocks now and then at
that point (common.distributed.gloo_destroyed_without_gil says why); 200 rounds at 3
ranks met it on every try. A deadlock holds the GIL, so the watchdog is
faulthandler's, which runs without it: it prints every thread's stack and exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from common.distributed import DistContext, all_ranks_agree, max_over_ranks, print0, teardown_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--watchdog", type=float, default=90, metavar="SECONDS", help="exit 1 after this long")
    args, _ = parser.parse_known_args()  # run_script's --device, --run-dir and the like mean nothing here
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    # Every teardown runs a full garbage collection (teardown_distributed says why); torch's
    # import-time objects, frozen, are left out of it, so 200 rounds take seconds, not minutes.
    gc.freeze()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's own store; each round's group keeps its keys under a prefix of its own.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    ctx = DistContext(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
    start = time.perf_counter()
    for round_ in range(args.rounds):
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"round-{round_}", store), rank=rank, world_size=world_size
        )
        max_over_ranks([float(rank)], ctx)
        all_ranks_agree(True, ctx)
        teardown_distributed()
    faulthandler.cancel_dump_traceback_later()
    print0(
        f"{args.rounds} rounds at {world_size} ranks in {time.perf_counter() - start:.1f} s, torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
