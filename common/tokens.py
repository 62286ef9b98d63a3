"""Real text for the transformer scripts and the checks of their data flags: ``--text-file`` (character-level, held
in memory) or ``--token-file`` (the ids tools.runs.prepare_tokens writes, in the format defined here, of any size)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from common.data import TokenData, markov_data
from common.flag_checks import check_synthetic_size, machine_memory
from common.run_dir import checkpoint_to_resume

TOKEN_DTYPE = "<u2"  # a token file's ids: little-endian uint16
TOKEN_BYTES = 2
MAX_VOCAB_SIZE = 1 << 16  # no token file holds an id of a larger vocabulary
SCAN_CHUNK_IDS = 1 << 24  # ids read at a time while a file is checked: a 32 MiB buffer, whatever its size


def token_metadata_path(tokens: Path) -> Path:
    """TOKENS.json: what tools.runs.prepare_tokens writes beside a token file about it."""
    return tokens.with_name(tokens.name + ".json")


class TokenWindows(Dataset):
    """(input, target) pairs of ``block_size`` + 1 consecutive ids of a token file from token ``first`` on, one
    window every ``block_size`` tokens, each read when asked for (one ``pread``): a rank never holds the corpus.
    A file changed since the run checked it stops the rank with a message: an id outside ``vocab_size`` (before an
    IndexError or a GPU's device assert), or a file cut short (a memory map would read zeros or die of SIGBUS)."""

    def __init__(self, path: Path, first: int, count: int, block_size: int, vocab_size: int) -> None:
        self.path, self.first, self.count, self.block_size, self.vocab_size = path, first, count, block_size, vocab_size
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


class BadTokenFile(ValueError):
    """A token file, or the TOKENS.json beside it, that training cannot use; the message says why."""


@dataclass(frozen=True)
class TokenFileInfo:  # what TOKENS.json says, each field checked by read_token_metadata
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
    tokens = whole_number(metadata, "tokens", described, 0, None)
    return TokenFileInfo(tokens, whole_number(metadata, "vocab_size", described, 1, MAX_VOCAB_SIZE), tokenizer)


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
    """(position, id) of the first id of ``path`` not below ``vocab_size``, or None: the whole file (TOKENS.json
    cannot vouch for it), SCAN_CHUNK_IDS at a time into one buffer. Not a memory map: every page it touches stays
    resident until unmapped, so a 2 GB file raised every rank's peak memory by 2 GB (measured); this holds 32 MiB."""
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
    """A token file's last ``heldout_windows`` windows held out (at most a tenth of it); every window before
    them trains. A fixed held-out count keeps an evaluation's cost the same whatever the corpus's size."""
    metadata = read_token_metadata(path)
    total, vocab_size = metadata.tokens, metadata.vocab_size
    held = max(1, min(heldout_windows, total // 10 // block_size))
    split = total - held * block_size - 1
    train = TokenWindows(path, 0, (split - 1) // block_size, block_size, vocab_size)
    heldout = TokenWindows(path, split, held, block_size, vocab_size)
    description = (
        f"{total:,} {metadata.tokenizer} tokens of {path} (vocab {vocab_size}), read a window at a time: "
        f"{len(train):,} train / {len(heldout):,} held-out windows"
    )
    return TokenData(train, heldout, vocab_size, None, description, {"tokenizer": metadata.tokenizer}, padded=False)


def check_text_file(parser: argparse.ArgumentParser, path: Path, block_size: int) -> None:
    """A text that text_data can hold and number, read a chunk at a time (every rank runs this)."""
    seen = np.zeros(UNICODE_CODE_POINTS, dtype=bool)
    characters = 0
    try:
        for codes in text_code_points(path):
            seen[codes] = True
            characters += len(codes)
    except FileNotFoundError:
        parser.error(f"--text-file {path}: no such file")
    except UnicodeDecodeError:
        parser.error(f"--text-file {path}: not UTF-8 text")
    except OSError as err:
        parser.error(f"--text-file {path}: cannot read it ({err.strerror})")
    needed = 10 * (block_size + 1)  # 90% trains and 10% is held out; each part needs at least one window
    if characters < needed:
        parser.error(
            f"--text-file {path} has {characters} characters; at --block-size {block_size} it needs at least {needed}"
        )
    distinct = int(np.count_nonzero(seen))
    if distinct > MAX_VOCAB_SIZE:
        parser.error(
            f"--text-file {path} holds {distinct:,} distinct characters; a character-level vocabulary holds at most "
            f"{MAX_VOCAB_SIZE:,} (uint16 ids). Prepare it as bytes with python -m tools.runs.prepare_tokens and give "
            "--token-file"
        )
    held = characters * TOKEN_BYTES
    if held > machine_memory():
        parser.error(
            f"--text-file {path} has {characters:,} characters: their ids would take {held / 2**30:,.1f} GiB per "
            f"process, more than this machine's {machine_memory() / 2**30:,.1f} GiB. Prepare it with python -m "
            "tools.runs.prepare_tokens and give --token-file, which is read a window at a time"
        )


def check_token_file(parser: argparse.ArgumentParser, path: Path, block_size: int, read_every_id: bool) -> None:
    """A token file and its TOKENS.json that agree and, with ``read_every_id``, every id inside the vocabulary (else
    an IndexError, a GPU's device assert, at the first batch with one). That reads the corpus (2 GB: 0.4 s cached,
    6 s from disk, measured), so a resumed run, whose start read it, leaves it to TokenWindows' per-window check."""
    if not path.is_file():
        parser.error(f"--token-file {path}: no such file")
    try:
        metadata = read_token_metadata(path)
    except BadTokenFile as err:
        parser.error(f"--token-file {path}: {err}")
    size = path.stat().st_size
    if size != 2 * metadata.tokens:
        parser.error(f"--token-file {path} holds {size} bytes; its .json says {metadata.tokens} uint16 tokens")
    needed = 10 * (block_size + 2)  # 90% trains and 10% is held out; each part needs at least one window
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
    """The data flags, once resolve_flags has filled in --block-size: one source the run can read and hold."""
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


def transformer_data(args: argparse.Namespace) -> TokenData:
    if args.text_file is not None:
        return text_data(args.text_file, args.block_size)
    if args.token_file is not None:
        return token_file_data(args.token_file, args.block_size, args.heldout_sequences)
    return markov_data(args.block_size, args.train_sequences, args.heldout_sequences, args.variable_length)


def text_data(path: Path, block_size: int) -> TokenData:
    """Character-level tokens of a UTF-8 text, the first 90% to train: uint16 ids, each window made when asked for
    (every window built up front as int64 took a 200 MB text's data to 5.7 GiB at its peak, this 0.42 GiB)."""
    ids, vocab = character_ids(path)
    split = int(len(ids) * 0.9)
    train, heldout = CharacterWindows(ids[:split], block_size), CharacterWindows(ids[split:], block_size)
    description = (
        f"characters of {path}: vocab {len(vocab)}, {len(train)} train / {len(heldout)} held-out windows "
        f"(a uniform guess costs {math.log(len(vocab)):.3f} nats/token)"
    )
    return TokenData(train, heldout, len(vocab), None, description, {"characters": vocab}, padded=False)


class CharacterWindows(Dataset):
    """(input, target) int64 pairs of ``block_size`` + 1 consecutive uint16 ids, one window every ``block_size``
    ids: each character is a target once."""

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
    """A UTF-8 text's code points a chunk at a time, as ``path.read_text`` gives them (\\r\\n and \\r read as
    \\n); UnicodeDecodeError where it is not UTF-8."""
    with path.open(encoding="utf-8") as text:
        while chunk := text.read(TEXT_CHUNK_CHARACTERS):
            yield np.frombuffer(chunk.encode("utf-32-le"), dtype="<u4")


def character_ids(path: Path) -> tuple[np.ndarray, str]:
    """A UTF-8 text's characters as uint16 ids, and its vocabulary ``sorted(set(text))``, an id its place there.
    One pass: ids numbered as characters first appear, then renumbered in code point order. The array is sized by
    the file's bytes (never fewer than its characters); pages past the last character are never written, so free."""
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
