"""Turn a training checkpoint into a plain ``model.pt`` for inference.

    python -m common.export_checkpoint RUN_DIR/checkpoints/step-N model.pt     # sharded (FSDP)
    python -m common.export_checkpoint RUN_DIR/checkpoints/step-N.pt model.pt  # full (DDP)

The output is the model's state dict alone, under the original parameter
names, as the training scripts' own ``model.pt``: it loads into the plain
model with ``load_state_dict`` and needs no process group. A sharded
checkpoint is merged in one process with torch.distributed.checkpoint's
format_utils, which reads every shard (optimizer state included), so the
machine needs memory for the whole checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.checkpoint import checkpoint_step, save_atomic


def read_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict from a sharded or full checkpoint."""
    if checkpoint.is_dir():
        with tempfile.TemporaryDirectory(dir=checkpoint.parent) as scratch:
            merged = Path(scratch) / "merged.pt"
            dcp_to_torch_save(checkpoint, merged)
            return torch.load(merged, weights_only=True)["model"]
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/step-N (a folder) or step-N.pt")
    parser.add_argument("output", type=Path, help="where to write the model's state dict")
    args = parser.parse_args(argv)
    if checkpoint_step(args.checkpoint) is None or not args.checkpoint.exists():
        parser.error(f"{args.checkpoint}: not a checkpoint (those are RUN_DIR/checkpoints/step-N or step-N.pt)")
    try:
        state = read_model_state(args.checkpoint)
    except Exception as err:  # noqa: BLE001 - any failure to read means the same thing to the user
        print(f"error: cannot read {args.checkpoint}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    save_atomic(state, args.output)
    parameters = sum(tensor.numel() for tensor in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {parameters:,} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
