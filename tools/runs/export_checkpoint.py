"""Turn a training checkpoint into a plain ``model.pt`` for inference.

    python -m tools.runs.export_checkpoint RUN_DIR/checkpoints/step-N model.pt     # sharded (FSDP)
    python -m tools.runs.export_checkpoint RUN_DIR/checkpoints/step-N.pt model.pt  # full (DDP)

The output is the model's state dict alone, under the original parameter
names, as the training scripts' own ``model.pt``: it loads into the plain
model with ``load_state_dict`` and needs no process group. A sharded
checkpoint is read in one process with torch.distributed.checkpoint, model
tensors only (not the optimizer's), so the machine needs memory for the whole
model. Nothing in the checkpoint runs as code: a sharded checkpoint whose
metadata holds more than DCP's own records is refused unless
--trust-checkpoint is given. An existing output file, a run's own model.pt
among them, is replaced only with --overwrite.

A run with LoRA adapters (--lora-rank) exports as its model.pt is written: the adapters merged into
the weights they adapt; --adapters-only writes the adapters alone.

A run of a Hugging Face model (docs/hugging-face.md) exports as a folder ``from_pretrained`` loads:

    python -m tools.runs.export_checkpoint RUN_DIR/checkpoints/step-N OUT_DIR --hf-config MODEL_DIR

``config.json`` comes from --hf-config (the folder the run started from, or the file itself), the
weights go to ``model.safetensors``, a tied weight once, under its first name, each under the name the
library's files give it (GPT-NeoX's head as embed_out.weight). Weights that do not fit the model of that
config (another family's, another shape) are refused before anything is written, as --init-from refuses them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from common.checkpoint import TRAINER_FILE
from common.cli import HelpFormatter, add_trust_flag
from common.distributed import FatalError
from common.fine_tuning import adapter_scale, is_adapter, merge_adapters, merged_with_scale
from common.flags import existing_path
from common.models import tied_parameters
from common.outputs import OVERWRITE_FLAG, holds_something, save_torch
from common.run_dir import CHECKPOINTS, LOCK_FILE, METRICS_FILE, RUN_RESULTS, checkpoint_step
from common.safe_io import UntrustedCheckpoint, describe_failure, load_file, root_failure, sharded_reader
from common.safetensors_weights import CONFIG_FILE, pretrained_folder, untied_problem, weights_problem, write_pretrained
from tools.command_flags import output_path
from tools.output_checks import add_overwrite_flag, check_output_path, folder_problem, same_file
from tools.processes import exit_code_of

# The one entry of an adapters file (tools.runs.export_checkpoint --adapters-only) that is not an adapter: the
# update's scale, alpha / rank, without which B A cannot be added to the weights it was trained for.
ADAPTERS_SCALE = "lora_scale"


def adapters_file(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """What --adapters-only writes: the adapters of ``state`` and their scale, for apply_adapters to read."""
    adapters = {name: value for name, value in state.items() if is_adapter(name)}
    return {**adapters, ADAPTERS_SCALE: torch.tensor(scale, dtype=torch.float64)}


def apply_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict from its base weights and an adapters file: each adapted weight
    ``W + scale * B A``, as the run's model.pt holds it. ValueError, saying why, if the two do not fit."""
    if ADAPTERS_SCALE not in adapters:
        raise ValueError(f"it has no {ADAPTERS_SCALE!r}: not written by tools.runs.export_checkpoint --adapters-only")
    layers = [name.removesuffix(".adapter.a") for name in adapters if name.endswith(".adapter.a")]
    for layer in layers:
        weight = base.get(f"{layer}.weight")
        a, b = adapters[f"{layer}.adapter.a"], adapters.get(f"{layer}.adapter.b")
        if weight is None or b is None or weight.shape != (b.shape[0], a.shape[1]):
            raise ValueError(f"its adapter of {layer} does not fit the base weights' {layer}.weight")
    only_adapters = {name: value for name, value in adapters.items() if is_adapter(name)}
    return merged_with_scale({**base, **only_adapters}, float(adapters[ADAPTERS_SCALE]))


MODEL_PREFIX = "model."  # the training scripts save {"model": ..., "optimizer": ...}


def read_model_state(checkpoint: Path, trust: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's full state dict from a sharded or full checkpoint, and what the checkpoint records of its
    run (``trainer``: flags, identity; empty if none)."""
    if checkpoint.is_dir():
        trainer = load_file(checkpoint / TRAINER_FILE)
        trainer = trainer if isinstance(trainer, dict) else {}
        return parts_together(read_sharded_model_state(checkpoint, trust), trainer), trainer
    saved = load_file(checkpoint)
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict) or not all(isinstance(value, torch.Tensor) for value in model.values()):
        raise ValueError("it holds no model state dict (a training checkpoint has one under 'model')")
    trainer = saved.get("trainer")
    return model, trainer if isinstance(trainer, dict) else {}


def parts_together(model: dict[str, torch.Tensor], trainer: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A sharded checkpoint of fsdp/train_transformer_fsdp2_tp.py split over ranks (its identity's "qkv") holds each
    fused q|k|v tensor as (3, rows / 3, ...), the boxes DCP can write (the script's parts_apart); the model's
    layout is (rows, ...). Exported as saved, its model.pt loaded into no GPT."""
    identity = trainer.get("identity")
    if not isinstance(identity, dict) or identity.get("qkv") != "3 parts":
        return model
    fused = ("attn.qkv.weight", "attn.qkv.bias")
    return {name: value.flatten(0, 1) if name.endswith(fused) else value for name, value in model.items()}


def recorded_settings(trainer: dict[str, Any]) -> dict[str, Any]:
    settings = trainer.get("settings")
    return settings if isinstance(settings, dict) else {}


def recorded_ties(trainer: dict[str, Any]) -> dict[str, str]:
    """The names under which the run's model holds one tensor twice (alias -> first name), as recorded."""
    identity = trainer.get("identity")
    tied = identity.get("tied") if isinstance(identity, dict) else None
    return tied if isinstance(tied, dict) else {}


def plain_or_adapters(state: dict[str, torch.Tensor], settings: dict[str, Any], adapters_only: bool) -> dict:
    """What to write: the plain model (LoRA adapters merged into their weights, as the run's model.pt), or
    with --adapters-only the adapters alone, for a user who keeps the base weights elsewhere."""
    if adapters_only:
        if not any(is_adapter(name) for name in state):
            raise ValueError("it holds no LoRA adapters (the run had no --lora-rank)")
        rank = settings.get("--lora-rank")
        if not isinstance(rank, int):
            raise ValueError("it holds LoRA adapters but records no --lora-rank, so their scale is unknown")
        return adapters_file(state, adapter_scale(rank, settings.get("--lora-alpha")))
    return merge_adapters(state, settings.get("--lora-rank"), settings.get("--lora-alpha"))


def read_sharded_model_state(folder: Path, trust: bool) -> dict[str, torch.Tensor]:
    """The model's tensors from a DCP checkpoint, gathered whole from every rank's shards."""
    reader, planner = sharded_reader(folder, trust)
    entries = reader.read_metadata().state_dict_metadata
    model = {
        name.removeprefix(MODEL_PREFIX): torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in entries.items()
        if name.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"it holds no model tensors (no entry starts with {MODEL_PREFIX!r})")
    with warnings.catch_warnings():
        # torch warns that there is no process group, so it loads in one process: that is the point here.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": model}, storage_reader=reader, planner=planner)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runs.export_checkpoint", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("checkpoint", type=existing_path, help="RUN_DIR/checkpoints/step-N (a folder) or step-N.pt")
    parser.add_argument(
        "output", type=output_path, help="where to write the model's state dict (a folder, with --hf-config)"
    )
    parser.add_argument(
        "--hf-config",
        type=existing_path,
        metavar="CONFIG",
        help="write OUTPUT as a Hugging Face folder (config.json and model.safetensors) that from_pretrained loads, "
        "with this config.json, or the one in this folder (the folder the run started from)",
    )
    parser.add_argument(
        "--adapters-only",
        action="store_true",
        help="write only the LoRA adapters of a --lora-rank run (default: the plain model, adapters merged in)",
    )
    add_trust_flag(parser)
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    if checkpoint_step(args.checkpoint) is None or not args.checkpoint.exists():
        parser.error(f"{args.checkpoint}: not a checkpoint (those are RUN_DIR/checkpoints/step-N or step-N.pt)")
    if overwrites_a_checkpoint(args.output, args.checkpoint):
        parser.error(
            f"{args.output}: that is where a run keeps its checkpoints, and --resume would take a bare state dict "
            "there for one; write it beside them, e.g. RUN_DIR/model-step-N.pt"
        )
    if args.output.name == METRICS_FILE:
        # --overwrite is for an export over an export (or over model.pt), never over the run's own record.
        parser.error(f"{args.output}: that is the name of a run's training log; write the export to a .pt file")
    holder = running_in(args.output.parent) if args.output.name in RUN_RESULTS else None
    if holder is not None:
        parser.error(
            f"{args.output}: a run is writing {args.output.parent} now ({holder}), and replaces its own "
            f"{args.output.name} when it ends; write the export beside it, e.g. {args.output.parent}/model-step-N.pt"
        )
    if args.hf_config is None:
        # A run's own model.pt is an existing file like any other: replaced only when the user says so.
        check_output_path(parser, args.output, "", [args.checkpoint], args.overwrite)
        return args
    if args.adapters_only:
        parser.error("--adapters-only writes the adapters as a state dict; --hf-config writes the whole model")
    config_holder = args.hf_config if args.hf_config.is_dir() else args.hf_config.parent
    if same_file(args.output, config_holder):
        parser.error(f"{args.output} is the folder --hf-config reads; write the export elsewhere, and keep the model")
    try:
        args.hf_config = config_text(args.hf_config)
    except ValueError as err:
        parser.error(f"--hf-config {args.hf_config}: {err}")
    problem = pretrained_output_problem(args.output, args.checkpoint, args.overwrite)
    if problem is not None:
        parser.error(problem)
    return args


def config_text(path: Path) -> str:
    """The text of the config.json that ``path`` is or holds, checked to be a Hugging Face config."""
    file = path / CONFIG_FILE if path.is_dir() else path
    try:
        text = file.read_text()
        config = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"cannot read {file.name} ({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{file.name} is no Hugging Face config (it has no model_type)")
    return text


def as_in_files(state: dict[str, torch.Tensor], config_text: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` under the names that the files of --hf-config's model give its tensors, and that model's ties (alias
    -> first name, as named there). ValueError where the weights do not fit that model: other names, shapes or dtypes,
    or a pair it ties held as two tensors; the same checks as --init-from's."""
    model = pretrained_model(config_text)  # first: it says so where transformers is not installed
    from examples.hf_model import names_in_files  # the copies' own: what their RUN_DIR/hf holds is what this writes

    try:
        in_files = names_in_files(model)
    except FatalError as err:  # a family these scripts cannot write, whatever the weights
        raise ValueError(f"cannot be written for --hf-config: {err}") from None
    tied = tied_parameters(model)
    expected = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()}
    found = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
    problem = weights_problem(found, expected, tied) or untied_problem(state, tied)
    if problem is not None:
        raise ValueError(f"{problem}, the {type(model).__name__} that --hf-config describes")
    renamed = {in_files.get(name, name): tensor for name, tensor in state.items()}
    return renamed, {in_files.get(alias, alias): in_files.get(name, name) for alias, name in tied.items()}


def pretrained_model(config_text: str) -> Any:
    """The model of a Hugging Face config, as the copies build it (fp32), on the meta device: names and shapes alone.
    ValueError where transformers builds no causal language model of it."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        raise ValueError("cannot be checked against --hf-config without the transformers package") from None
    fields = json.loads(config_text)
    try:
        config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"is no causal language model's: transformers builds none from --hf-config ({err})") from None


def pretrained_output_problem(output: Path, checkpoint: Path, overwrite: bool) -> str | None:
    """Why the folder ``output`` cannot take a Hugging Face export of ``checkpoint``; None if it can."""
    if output.resolve() == checkpoint.resolve() or output.resolve() in checkpoint.resolve().parents:
        return f"{output} holds the checkpoint it would be written from; write the folder elsewhere"
    if output.exists() and not output.is_dir():
        return f"{output} is a file; --hf-config writes a folder there"
    if holds_something(output) and not overwrite:
        return f"{output} exists; choose another name, or pass {OVERWRITE_FLAG} to replace it"
    if holds_something(output) and not pretrained_folder(output):
        return f"{output} holds more than a Hugging Face model; {OVERWRITE_FLAG} replaces only such a folder"
    return folder_problem(output.parent, str(output))


def running_in(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s run lock (common.run_dir), if a run is writing there now; else None.

    The test takes the lock shared and at once lets it go: a run starting in that instant is refused
    as if another run were there, which it may retry; taking nothing cannot tell a held lock apart.
    """
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run has written there, or none since the folder was copied
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 4096).decode(errors="replace").strip() or "it has not said who it is yet"
    except OSError:
        return None  # a file system without locks: the run itself goes on unguarded there
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        state, trainer = read_model_state(args.checkpoint, trust=args.trust_checkpoint)
    # DCP's CheckpointException is a BaseException, so it is named here.
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - any failure to read means one thing here
        cause = root_failure(err)
        if isinstance(cause, UntrustedCheckpoint):
            return fail(cause.refusal(args.checkpoint))
        return fail(f"cannot read {args.checkpoint}: {describe_failure(err)}")
    try:
        state = plain_or_adapters(state, recorded_settings(trainer), args.adapters_only)
    except ValueError as err:
        return fail(f"{args.checkpoint}: {err}")
    tied = recorded_ties(trainer)
    if args.hf_config is not None:
        try:
            state, tied = as_in_files(state, args.hf_config)
        except ValueError as err:
            return fail(f"{args.checkpoint} {err}; nothing was written")
    try:
        if args.hf_config is None:
            save_torch(state, args.output, args.overwrite)
        else:
            write_pretrained(state, args.output, args.hf_config, tied, args.overwrite)
    except OSError as err:
        return fail(f"cannot write {args.output}: {err.strerror or err}")
    written = [tensor for name, tensor in state.items() if args.hf_config is None or name not in tied]  # a tie once
    print(f"wrote {args.output}: {len(written)} tensors, {sum(tensor.numel() for tensor in written):,} values")
    return 0


def overwrites_a_checkpoint(output: Path, checkpoint: Path) -> bool:
    """The checkpoint itself, a file inside it (a sharded one is a folder), or anything in a checkpoints/ folder."""
    output, checkpoint = output.resolve(), checkpoint.resolve()
    return output == checkpoint or checkpoint in output.parents or output.parent.name == CHECKPOINTS


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    # A SIGTERM unwinds as Ctrl-C does, so the output's temporary is removed rather than left behind.
    sys.exit(exit_code_of(main, "python -m tools.runs.export_checkpoint"))
