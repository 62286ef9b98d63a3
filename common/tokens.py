"""Data for the transformer scripts, with nothing to download.

By default the tokens come from a fixed random Markov source. Because we know
its transition probabilities, we know the lowest loss any model can reach on
it, and a run can say how close it got. ``--text-file`` trains character-level
on any text instead, held in memory; ``--token-file`` trains on a file of token
ids (tools.runs.prepare_tokens) of any size, read a window at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from common.data import IGNORE_INDEX
from common.flag_checks import check_synthetic_size, machine_memory
from common.run_dir import checkpoint_to_resume
from common.token_format import MAX_VOCAB_SIZE, TOKEN_BYTES, TOKEN_DTYPE, token_metadata_path

# The source is part of the task, not of the run: a fixed seed keeps it the same
# whatever --seed the training uses, so runs with different seeds are comparable.
MARKOV_SEED = 1234


@dataclass
class TokenData:
    train: Dataset  # (input, target) pairs of shape (block_size,)
    heldout: Dataset
    vocab_size: int
    entropy_floor: float | None  # nats per token; None for real text
    description: str
    # How tools.runs.sample turns ids back into text: {"characters": "..."} or {"tokenizer": "bytes"}; {} for ids only.
    decoding: dict[str, Any] = field(default_factory=dict)
    # Whether a target can be IGNORE_INDEX. Only data that never pads lets a step know its token count in
    # advance (common.training.TokenCount); yours is counted, step by step, unless you say otherwise.
    padded: bool = True


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats along the last dimension, treating 0 log 0 as 0."""
    return -(probs * probs.clamp_min(1e-300).log()).sum(-1)


class MarkovSource:
    """Tokens where each one depends on the ``order`` tokens before it.

    A state is the tuple of the last ``order`` tokens, numbered in base
    ``vocab_size``. Each state has its own next-token distribution: a softmax
    of random logits, where a larger ``logit_scale`` makes the rows more
    peaked, so the source is predictable but not trivially so.
    """

    def __init__(self, vocab_size: int = 16, order: int = 2, logit_scale: float = 3.0) -> None:
        generator = torch.Generator().manual_seed(MARKOV_SEED)
        self.vocab_size, self.order = vocab_size, order
        self.num_states = vocab_size**order
        logits = logit_scale * torch.randn(self.num_states, vocab_size, dtype=torch.float64, generator=generator)
        self.transition = logits.softmax(-1)
        self.stationary = self._stationary_distribution()

    def _next_state(self, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (state % (self.num_states // self.vocab_size)) * self.vocab_size + token

    def _stationary_distribution(self) -> torch.Tensor:
        """Solve pi = pi T for the chain on states, exactly, as a linear system."""
        states = torch.arange(self.num_states).repeat_interleave(self.vocab_size)
        tokens = torch.arange(self.vocab_size).repeat(self.num_states)
        state_transition = torch.zeros(self.num_states, self.num_states, dtype=torch.float64)
        state_transition.index_put_(
            (states, self._next_state(states, tokens)), self.transition.flatten(), accumulate=True
        )
        # (T^t - I) pi = 0 with one equation swapped for sum(pi) = 1.
        system = state_transition.T - torch.eye(self.num_states, dtype=torch.float64)
        system[-1] = 1.0
        rhs = torch.zeros(self.num_states, dtype=torch.float64)
        rhs[-1] = 1.0
        return torch.linalg.solve(system, rhs)

    def entropy_rate(self) -> float:
        """Nats per token of an ideal predictor that sees the full ``order`` tokens of context."""
        return float((self.stationary * _entropy(self.transition)).sum())

    def loss_floor(self, block_size: int) -> float:
        """Lowest mean loss over the ``block_size`` targets of a sequence that starts fresh.

        The first targets have fewer than ``order`` tokens of context, so they
        cost a little more than the entropy rate. By the chain rule the total
        is H(first block_size + 1 tokens) - H(first token).
        """
        first_tokens = self.stationary.view(self.vocab_size, -1).sum(-1)
        whole_sequence = float(_entropy(self.stationary)) + (block_size + 1 - self.order) * self.entropy_rate()
        return (whole_sequence - float(_entropy(first_tokens))) / block_size

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Independent sequences, each started from the stationary distribution."""
        state = torch.multinomial(self.stationary, num_sequences, replacement=True, generator=generator)
        tokens = torch.empty(num_sequences, length, dtype=torch.long)
        # The first `order` tokens are the digits of the starting state.
        for position in range(self.order):
            tokens[:, position] = (state // self.vocab_size ** (self.order - 1 - position)) % self.vocab_size
        cumulative = self.transition.cumsum(-1)
        for position in range(self.order, length):
            uniform = torch.rand(num_sequences, 1, dtype=torch.float64, generator=generator)
            token = torch.searchsorted(cumulative[state], uniform).squeeze(1).clamp_max(self.vocab_size - 1)
            tokens[:, position] = token
            state = self._next_state(state, token)
        return tokens


def _pairs(sequences: torch.Tensor, lengths: torch.Tensor | None = None) -> TensorDataset:
    """Next-token prediction: the target is the input shifted by one.

    With ``lengths``, sequence i keeps its first lengths[i] targets; the rest are padding, IGNORE_INDEX
    as targets and 0 as inputs, which a causal model reads only for the padded positions' own predictions.
    """
    inputs, targets = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    if lengths is not None:
        padding = torch.arange(targets.shape[1]) >= lengths[:, None]
        inputs[padding], targets[padding] = 0, IGNORE_INDEX
    return TensorDataset(inputs, targets)


def markov_data(
    block_size: int, train_sequences: int, heldout_sequences: int, variable_length: bool = False
) -> TokenData:
    """``variable_length``: each sequence cut to 1 to block_size tokens, drawn from the data's seed, and padded."""
    source = MarkovSource()
    generator = torch.Generator().manual_seed(MARKOV_SEED + 1)
    count = train_sequences + heldout_sequences
    sequences = source.sample(count, block_size + 1, generator)
    lengths = torch.randint(1, block_size + 1, (count,), generator=generator) if variable_length else None
    if lengths is None:
        floor = source.loss_floor(block_size)
        shape = f"loss floor {floor:.4f} at block size {block_size}"
    else:
        # The held-out loss is a mean over tokens: each sequence's floor weighs by its length.
        heldout = lengths[train_sequences:].tolist()
        floor = sum(length * source.loss_floor(length) for length in heldout) / sum(heldout)
        shape = f"lengths 1 to {block_size} (padded), held-out loss floor {floor:.4f}"
    description = (
        f"synthetic Markov tokens: vocab {source.vocab_size}, order {source.order}, "
        f"{train_sequences} train / {heldout_sequences} held-out sequences; "
        f"entropy rate {source.entropy_rate():.4f} nats/token, {shape}"
    )
    train_lengths, heldout_lengths = (
        (None, None) if lengths is None else lengths.split([train_sequences, heldout_sequences])
    )
    return TokenData(
        _pairs(sequences[:train_sequences], train_lengths),
        _pairs(sequences[train_sequences:], heldout_lengths),
        source.vocab_size,
        floor,
        description,
        padded=variable_length,
    )


def text_data(path: Path, block_size: int, heldout_fraction: float = 0.1) -> TokenData:
    """Character-level tokens from a UTF-8 text file: the first 90% trains, the rest is held out.

    The ids are held as uint16, 2 bytes a character, and each window is made when it is asked for:
    every window built up front as int64 pairs took a 200 MB text's data to 5.7 GiB at its peak, where
    this takes 0.42 GiB (measured).
    """
    ids, vocab = character_ids(path)
    split = int(len(ids) * (1 - heldout_fraction))
    train, heldout = CharacterWindows(ids[:split], block_size), CharacterWindows(ids[split:], block_size)
    description = (
        f"characters of {path}: vocab {len(vocab)}, {len(train)} train / {len(heldout)} held-out windows "
        f"(a uniform guess costs {math.log(len(vocab)):.3f} nats/token)"
    )
    return TokenData(train, heldout, len(vocab), None, description, {"characters": vocab}, padded=False)


class CharacterWindows(Dataset):
    """(input, target) pairs of ``block_size`` + 1 consecutive ids, one window every ``block_size`` ids:
    each character is a target once. The pair is int64, made from the uint16 ids when asked for."""

    def __init__(self, ids: np.ndarray, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size
        self.count = (len(ids) - 1) // block_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        start = index * self.block_size
        window = torch.from_numpy(self.ids[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


# Characters decoded at a time: the chunk's code points as uint32 take 16 MiB, whatever the text's size.
TEXT_CHUNK_CHARACTERS = 1 << 22
UNICODE_CODE_POINTS = 0x110000  # a slot for each in the lookup tables: 1.1 MiB each as bool, 2.2 as uint16


def text_code_points(path: Path) -> Iterator[np.ndarray]:
    """The code points of a UTF-8 text, a chunk at a time, as ``path.read_text`` would give them: its
    newlines translated (\\r\\n and \\r read as \\n). UnicodeDecodeError where it is not UTF-8."""
    with path.open(encoding="utf-8") as text:
        while chunk := text.read(TEXT_CHUNK_CHARACTERS):
            yield np.frombuffer(chunk.encode("utf-32-le"), dtype="<u4")


def text_character_counts(path: Path) -> tuple[int, int]:
    """(characters, distinct characters) of a UTF-8 text, read a chunk at a time."""
    seen = np.zeros(UNICODE_CODE_POINTS, dtype=bool)
    characters = 0
    for codes in text_code_points(path):
        seen[codes] = True
        characters += len(codes)
    return characters, int(np.count_nonzero(seen))


def character_ids(path: Path) -> tuple[np.ndarray, str]:
    """The ids of a UTF-8 text's characters as uint16, and its vocabulary: every character it holds,
    in code point order (``sorted(set(text))``), a character's id its place there.

    One pass: ids are numbered as characters first appear, then renumbered in code point order.
    The array is sized by the file's bytes, never fewer than its characters; the pages past the last
    character are never written, so they take no memory.
    """
    capacity = path.stat().st_size
    ids = np.empty(capacity, dtype=np.uint16)
    first_seen_id = np.zeros(UNICODE_CODE_POINTS, dtype=np.uint16)
    seen = np.zeros(UNICODE_CODE_POINTS, dtype=bool)
    in_chunk = np.zeros(UNICODE_CODE_POINTS, dtype=bool)
    distinct = length = 0
    for codes in text_code_points(path):
        if length + len(codes) > capacity:
            raise ValueError(f"{path} grew while it was read; run again when it is complete")
        in_chunk[:] = False
        in_chunk[codes] = True
        new = np.flatnonzero(in_chunk & ~seen)
        if distinct + len(new) > MAX_VOCAB_SIZE:
            raise ValueError(
                f"{path} holds more than {MAX_VOCAB_SIZE} distinct characters, more than uint16 ids can number"
            )
        first_seen_id[new] = np.arange(distinct, distinct + len(new))
        seen[new] = True
        distinct += len(new)
        ids[length : length + len(codes)] = first_seen_id[codes]
        length += len(codes)
    ids = ids[:length]
    code_points = np.flatnonzero(seen)
    in_order = np.empty(distinct, dtype=np.uint16)
    in_order[first_seen_id[code_points]] = np.arange(distinct)
    # Most texts show every character in their first chunk, already numbered in code point order.
    if not np.array_equal(in_order, np.arange(distinct)):
        for start in range(0, length, TEXT_CHUNK_CHARACTERS):
            ids[start : start + TEXT_CHUNK_CHARACTERS] = in_order[ids[start : start + TEXT_CHUNK_CHARACTERS]]
    return ids, "".join(map(chr, code_points))


class TokenWindows(Dataset):
    """(input, target) pairs of ``block_size`` + 1 consecutive ids of a token file, from token ``first``
    on, one window every ``block_size`` tokens: each token is a target once.

    The file is opened in each process on first use, and a window is read when it is asked for (one
    ``pread``), so a rank's memory holds the windows it trains on, never the corpus. The file changed
    after the run checked it stops the rank with a message that names the file: an id outside
    ``vocab_size``, before the embedding's IndexError or a GPU's device assert could; a file cut short,
    where a memory map would have read zeros or died of SIGBUS.
    """

    def __init__(self, path: Path, first: int, count: int, block_size: int, vocab_size: int) -> None:
        self.path, self.first, self.count, self.block_size = path, first, count, block_size
        self.vocab_size = vocab_size
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        if not 0 <= index < self.count:
            raise IndexError(index)
        start = self.first + index * self.block_size
        wanted = (self.block_size + 1) * TOKEN_BYTES
        data = os.pread(self._fd, wanted, start * TOKEN_BYTES)
        if len(data) < wanted:
            raise ValueError(
                f"{self.path} changed under the run: it ends at token {os.fstat(self._fd).st_size // TOKEN_BYTES:,}, "
                f"before the window of tokens {start:,} to {start + self.block_size:,}. Check the file, or prepare it "
                "again with tools.runs.prepare_tokens"
            )
        ids = np.frombuffer(data, dtype=TOKEN_DTYPE)
        if ids.max() >= self.vocab_size:  # numpy's max on the uint16 ids: a few microseconds a window
            offset = int(np.argmax(ids >= self.vocab_size))
            raise ValueError(
                f"{self.path} changed under the run: token {start + offset:,} is id {int(ids[offset])}, outside "
                f"its vocabulary of {self.vocab_size}. Check the file, or prepare it again with "
                "tools.runs.prepare_tokens"
            )
        window = torch.from_numpy(ids.astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # a DataLoader worker opens the file itself


SCAN_CHUNK_IDS = 1 << 24  # ids read at a time while a file is checked: a 32 MiB buffer, whatever its size


class BadTokenFile(ValueError):
    """A token file, or the TOKENS.json beside it, that training cannot use; the message says why."""


@dataclass(frozen=True)
class TokenFileInfo:
    """What TOKENS.json says, each field checked for what tools.runs.prepare_tokens writes."""

    tokens: int
    vocab_size: int
    tokenizer: str


def read_token_metadata(path: Path) -> TokenFileInfo:
    """The TOKENS.json beside ``path``; BadTokenFile if it is missing, not JSON, or a field is not what
    tools.runs.prepare_tokens writes (a vocab_size of 0, of a trillion, a word)."""
    described = token_metadata_path(path)
    try:
        metadata = json.loads(described.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadTokenFile(f"no {described.name} beside it; tools.runs.prepare_tokens writes both") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadTokenFile(f"{described} cannot be read as JSON ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, dict):
        raise BadTokenFile(f"{described} holds a {type(metadata).__name__}, not the object prepare_tokens writes")
    tokenizer = metadata.get("tokenizer")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise BadTokenFile(f"{described}: tokenizer is {tokenizer!r}, not the name of one")
    if metadata.get("dtype", "uint16") != "uint16":
        raise BadTokenFile(f"{described}: dtype is {metadata['dtype']!r}; token files hold uint16 ids")
    return TokenFileInfo(
        tokens=whole_number(metadata, "tokens", described, 0, None),
        vocab_size=whole_number(metadata, "vocab_size", described, 1, MAX_VOCAB_SIZE),
        tokenizer=tokenizer,
    )


def whole_number(metadata: dict[str, Any], key: str, described: Path, low: int, high: int | None) -> int:
    if key not in metadata:
        raise BadTokenFile(f"{described} has no {key}; tools.runs.prepare_tokens writes it")
    value = metadata[key]
    # bool is an int to Python, but true is no count.
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        limits = f"from {low} to {high}" if high is not None else f"of at least {low}"
        why = " (the ids are uint16)" if key == "vocab_size" else ""
        raise BadTokenFile(f"{described}: {key} is {value!r}; it must be a whole number {limits}{why}")
    return value


def first_id_outside(path: Path, tokens: int, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id of ``path`` that is not below ``vocab_size``; None if there is none.

    The whole file is read, SCAN_CHUNK_IDS at a time into one buffer: what TOKENS.json says cannot vouch
    for bytes changed after it was written. Plain reads, not a memory map: every page a map touches stays
    in the process's resident set until it is unmapped, so a 2 GB file read that way raised the run's
    peak memory by 2 GB in every rank (measured), where this holds 32 MiB whatever the file's size.
    """
    if vocab_size >= MAX_VOCAB_SIZE or tokens == 0:  # every uint16 is an id of the vocabulary
        return None
    chunk = np.empty(SCAN_CHUNK_IDS, dtype=TOKEN_DTYPE)
    start = 0
    with path.open("rb", buffering=0) as ids:
        while start < tokens:
            read = ids.readinto(memoryview(chunk).cast("B")) // TOKEN_BYTES
            if read == 0:
                break  # cut short since it was measured: TokenWindows names the file when it meets the end
            window = chunk[: min(read, tokens - start)]
            if window.max() >= vocab_size:
                offset = int(np.argmax(window >= vocab_size))
                return start + offset, int(window[offset])
            start += read
    return None


def token_file_data(path: Path, block_size: int, heldout_windows: int) -> TokenData:
    """A token file's last ``heldout_windows`` windows held out (at most a tenth of it), which never
    train; every window before them trains. A fixed held-out count keeps an evaluation's cost the same
    whatever the corpus's size."""
    metadata = read_token_metadata(path)
    total = metadata.tokens
    held = max(1, min(heldout_windows, total // 10 // block_size))
    split = total - held * block_size - 1
    train = TokenWindows(path, 0, (split - 1) // block_size, block_size, metadata.vocab_size)
    heldout = TokenWindows(path, split, held, block_size, metadata.vocab_size)
    description = (
        f"{total:,} {metadata.tokenizer} tokens of {path} (vocab {metadata.vocab_size}), read a window at a time: "
        f"{len(train):,} train / {len(heldout):,} held-out windows"
    )
    decoding = {"tokenizer": metadata.tokenizer}
    return TokenData(train, heldout, metadata.vocab_size, None, description, decoding, padded=False)


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


def check_data_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The transformer's data flags, after check_transformer_flags has filled --block-size: one source, and
    one the run can read and hold."""
    if args.text_file is not None and args.token_file is not None:
        parser.error("give --text-file or --token-file, not both")
    if args.text_file is not None:
        check_text_file(parser, args.text_file, args.block_size)
    if args.token_file is not None:
        # A requeued or restarted run read the whole file when it started: only a fresh start reads it again.
        fresh = checkpoint_to_resume(args.run_dir, args.resume, args.resume_from) is None
        check_token_file(parser, args.token_file, args.block_size, read_every_id=fresh)
    if args.variable_length and (args.text_file or args.token_file):
        parser.error("--variable-length cuts the synthetic sequences; the windows of a text or token file are whole")
    if args.text_file is None and args.token_file is None:
        check_synthetic_size(parser, args)
