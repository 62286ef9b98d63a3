"""The argparse types only commands take (an existing folder to read, an output file or path), and the check
that two of a command's outputs name two paths. Each carries its kind (common.flags.flag_kind), which
tests/test_every_flag.py reads to choose the hostile values it tries."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from common.flags import (
    EXISTING_DIR,
    INTEGER,
    OUTPUT_DIR,
    OUTPUT_FILE,
    OUTPUT_PATH,
    _refuse_a_file,
    _refuse_long_names,
    _refuse_unwritable,
    flag_kind,
    float_in_range,
    int_in_range,
    path_kind,
    positive_int,
    shown,
)
from tools.output_checks import same_file

# The kind of a flag that sizes a dimension of the model's tensors (tests/test_every_flag.py tries on it values whose
# tensors torch cannot count, beside those past 64 bits).
DIMENSION = "tensor dimension"


def positive_int_up_to(limit: int, unit: str, why: str, *, name: str, kind: str = INTEGER) -> Callable[[str], int]:
    """Whole numbers from 1 to ``limit``, where a larger one is a job too long to run; the refusal says ``why``."""

    @flag_kind(kind)
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit:,} {unit}, got {shown(text)}: {why}")
        return value

    parse.__name__ = name
    return parse


# The estimators' sizes of a model (tools.estimates.estimate_memory and estimate_communication).
# A trillion parameters. The estimates list DDP's buckets, 25 MiB each: 1.5 million of them at 1e13
# parameters, and 1e30 overflowed (OverflowError).
parameter_count = float_in_range(1, 1e12, name="parameter_count")
# Far more FSDP units than any model has: the estimate lists each unit's collectives per micro-step.
layer_count = int_in_range(1, 10_000, name="layer_count")


# --model's activations come from one fake step of the GPT (tools.estimates.activations), whose time grows faster
# than its Blocks: the tiny preset took 14 s at 12 and 24 Blocks, 31 s at 48, 154 s (142 CPU-s) at 128, and was
# stopped after 10 minutes at 1,000, with another process on the second core. 128 is past the deepest
# published models (Llama 3.1 405B: 126 Blocks); --params with --layers answers for any depth at once.
MAX_BLOCKS = 128


block_count = positive_int_up_to(
    MAX_BLOCKS,
    "Blocks",
    "the fake step that measures the activations takes minutes at 128; --params N --layers L (no --model) "
    "estimates the model state of any depth at once",
    name="n_layer",
    kind=DIMENSION,
)
# tools.estimates.estimate_communication lists each Block's collectives: 1,000 Blocks took 23 s, 10,000 minutes.
unit_count = positive_int_up_to(
    MAX_BLOCKS,
    "Blocks",
    "--params N --layers L (no --model) estimates any depth at once",
    name="n_layer",
    kind=DIMENSION,
)

# The rest of the GPT's shape in the estimators and tools.estimates.simulate, each far past what published models
# use: the estimates build the model's tensors (fake ones), and torch counts a tensor's bytes in 63 bits. --d-model
# 1000000000 made a q|k|v weight of 3 x 10**18 values: "Storage size calculation overflowed", a traceback.
PAST_PUBLISHED = "far past published models"
width = positive_int_up_to(
    2**16, "features", f"{PAST_PUBLISHED} (Llama 3.1 405B: 16,384)", name="d_model", kind=DIMENSION
)
head_count = positive_int_up_to(2**16, "heads", "heads divide --d-model, at most 65,536", name="n_head", kind=DIMENSION)
context_length = positive_int_up_to(
    2**20, "tokens", f"{PAST_PUBLISHED} (Llama 3.1: 131,072 tokens)", name="block_size", kind=DIMENSION
)
vocabulary_size = positive_int_up_to(
    2**22, "tokens", f"{PAST_PUBLISHED} (Gemma 3: 262,144 tokens)", name="vocab_size", kind=DIMENSION
)
micro_batch_size = positive_int_up_to(
    2**16, "sequences or images", "far past what one GPU holds in a micro-step", name="batch_size", kind=DIMENSION
)


@path_kind(EXISTING_DIR)
def existing_dir(text: str) -> Path:
    path = Path(text)
    _refuse_a_file(text, path)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    return path


@path_kind(OUTPUT_FILE)
def output_file(text: str) -> Path:
    """A file this run may create (or replace, where its command allows that): not a folder, not below a file."""
    path = Path(text)
    if path.is_dir() or text.endswith(("/", "/.")):  # Path drops the slash that says the user means a folder
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the name of the file to write")
    _refuse_unwritable(text, path.parent)
    _refuse_long_names(text, path)
    return path


@path_kind(OUTPUT_PATH)
def output_path(text: str) -> Path:
    """A file or folder this run may create (or replace, where its command allows that): not below a file."""
    path = Path(text)
    _refuse_unwritable(text, path.parent)
    _refuse_long_names(text, path)
    return path


def refuse_outputs_on_one_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, two of the command's outputs (its flags of an output kind, as parsed into ``args``)
    on one path: the second would meet the first's file after all the work, and be refused as if another process
    had written it, or replace it. Two folders may share one: a run's folder can hold the data it reads."""
    named = []
    for action in parser._actions:
        kind, value = getattr(action.type, "kind", None), getattr(args, action.dest, None)
        if kind in (OUTPUT_FILE, OUTPUT_DIR, OUTPUT_PATH) and value is not None:
            flag = action.option_strings[-1] if action.option_strings else str(action.metavar or action.dest)
            named += [(flag, kind, path) for path in (value if isinstance(value, list) else [value])]
    for index, (flag, kind, path) in enumerate(named):
        for other_flag, other_kind, other in named[index + 1 :]:
            if not kind == other_kind == OUTPUT_DIR and same_file(path, other):
                parser.error(f"{flag} and {other_flag} both name {path}: give each output a path of its own")


# With --model, each rank's share of every tensor is worked out rank by rank (FSDP2 pads each tensor's pieces): the
# tiny preset took 8.6 s at 131,072 ranks and over a minute at 1,000,000, where --world-size 2**61 ran on unended.
MOST_RANKS_WITH_A_MODEL = 2**17


def refuse_too_many_ranks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--world-size past MOST_RANKS_WITH_A_MODEL with --model: refused with the way that answers at once."""
    if args.model is not None and args.world_size > MOST_RANKS_WITH_A_MODEL:
        parser.error(
            f"--world-size {args.world_size} with --model: each rank's share of every tensor is worked out in turn "
            f"(over a minute at 1,000,000 ranks), up to {MOST_RANKS_WITH_A_MODEL:,}; --params P --layers L (no "
            "--model) estimates the model state of any world size at once"
        )
