"""What a transformer run is given, refused before it starts if the run could not use it.

A text or token file that cannot be read, is too short for the context length, or holds ids its
vocabulary lacks; synthetic data or weights larger than this machine's memory. Each is found here,
with one message naming the flag, instead of by a reader or the allocator after the process group
is up. The rules mirror how common.tokens splits and stores the data and how common.models sizes
a GPT, and change with them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common.token_format import MAX_VOCAB_SIZE, TOKEN_BYTES, token_metadata_path
from common.tokens import BadTokenFile, first_id_outside, read_token_metadata, text_character_counts


def machine_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A model whose fp32 weights alone exceed this machine's memory is refused now, not by the allocator.

    Its Blocks' weights (12 d^2 each) and position embeddings are counted; the vocabulary's rows, which
    depend on the data, are left out, so this refuses only what cannot be built.
    """
    weights = 4 * (12 * args.n_layer * args.d_model**2 + args.block_size * args.d_model)
    if weights > machine_memory():
        parser.error(
            f"--n-layer {args.n_layer} --d-model {args.d_model} --block-size {args.block_size}: the weights alone "
            f"would take {weights / 2**30:,.0f} GiB, more than this machine's {machine_memory() / 2**30:,.0f} GiB"
        )


def check_synthetic_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Synthetic sequences that could not fit in this machine's memory are refused now, not by the allocator."""
    sequences = args.train_sequences + args.heldout_sequences
    needed = sequences * (args.block_size + 1) * 8  # int64 ids, one more than the context for the targets
    memory = machine_memory()
    if needed > memory:
        parser.error(
            f"--train-sequences {args.train_sequences} and --heldout-sequences {args.heldout_sequences} at "
            f"--block-size {args.block_size}: the synthetic data would take {needed / 2**30:,.0f} GiB per process, "
            f"more than this machine's {memory / 2**30:,.0f} GiB"
        )


def check_text_file(parser: argparse.ArgumentParser, path: Path, block_size: int) -> None:
    """A text that common.tokens.text_data can hold and number, read a chunk at a time: this runs in
    every rank before training, so it keeps no more than a chunk of it."""
    try:
        characters, distinct = text_character_counts(path)
    except FileNotFoundError:
        parser.error(f"--text-file {path}: no such file")
    except UnicodeDecodeError:
        parser.error(f"--text-file {path}: not UTF-8 text")
    except OSError as err:
        parser.error(f"--text-file {path}: cannot read it ({err.strerror})")
    # 90% trains and 10% is held out; each part needs at least one window.
    needed = 10 * (block_size + 1)
    if characters < needed:
        parser.error(
            f"--text-file {path} has {characters} characters; at --block-size {block_size} it needs at least {needed}"
        )
    if distinct > MAX_VOCAB_SIZE:
        parser.error(
            f"--text-file {path} holds {distinct:,} distinct characters; a character-level vocabulary holds at most "
            f"{MAX_VOCAB_SIZE:,} (uint16 ids). Prepare it as bytes with python -m tools.runs.prepare_tokens and give "
            "--token-file"
        )
    # Every process holds a uint16 id for each character; a --token-file is read a window at a time instead.
    held = characters * TOKEN_BYTES
    if held > machine_memory():
        parser.error(
            f"--text-file {path} has {characters:,} characters: their ids would take {held / 2**30:,.1f} GiB per "
            f"process, more than this machine's {machine_memory() / 2**30:,.1f} GiB. Prepare it with python -m "
            "tools.runs.prepare_tokens and give --token-file, which is read a window at a time"
        )


def check_token_file(parser: argparse.ArgumentParser, path: Path, block_size: int, read_every_id: bool) -> None:
    """A token file and its TOKENS.json that agree, and, with ``read_every_id``, every id in the file inside the
    vocabulary: the model has a row for each, instead of an IndexError (a device assert on a GPU) at the first
    batch that holds one. Reading them is reading the corpus: 2 GB took 0.4 s from the page cache and 6 s from
    this machine's disk (measured), so a resumed run, whose start read them, leaves it to TokenWindows, which
    checks each window as it reads it."""
    if not path.is_file():
        parser.error(f"--token-file {path}: no such file")
    try:
        metadata = read_token_metadata(path)
    except BadTokenFile as err:
        parser.error(f"--token-file {path}: {err}")
    size = path.stat().st_size
    if size != 2 * metadata.tokens:
        parser.error(f"--token-file {path} holds {size} bytes; its .json says {metadata.tokens} uint16 tokens")
    # 90% trains and 10% is held out; each part needs at least one window.
    needed = 10 * (block_size + 2)
    if metadata.tokens < needed:
        parser.error(
            f"--token-file {path} has {metadata.tokens} tokens; --block-size {block_size} needs at least {needed}"
        )
    if not read_every_id:
        return
    try:
        outside = first_id_outside(path, metadata.tokens, metadata.vocab_size)
    except OSError as err:
        parser.error(f"--token-file {path}: cannot read it ({err.strerror or err})")
    if outside is not None:
        position, token = outside
        parser.error(
            f"--token-file {path} holds id {token} (token {position:,}), but {token_metadata_path(path).name} says "
            f"vocab_size {metadata.vocab_size}: the model would have no row for it. Was either file changed after "
            "tools.runs.prepare_tokens wrote them?"
        )
