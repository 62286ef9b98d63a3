"""Turn text files into one flat file of token ids, for the transformer scripts' --token-file.

    python -m tools.runs.prepare_tokens book1.txt book2.txt --output data/books.tokens
    torchrun --standalone --nproc_per_node=4 fsdp/train_transformer_fsdp2.py --token-file data/books.tokens

The tokens are the text's bytes: every byte of the UTF-8 text is one token, a vocabulary of 256, so
no tokenizer package is needed and any text (any language, any symbols) works. A real tokenizer
gives shorter sequences for the same text: replace ``encode`` and ``VOCAB_SIZE`` below (YOUR
TOKENIZER), for example with tiktoken's ``get_encoding("gpt2").encode_ordinary`` and 50257, or a
sentencepiece model's ``encode`` and its vocabulary size. Ids are stored as uint16, so up to 65536.

The files are read a chunk at a time and the ids appended as they come, so memory stays the same
whatever the corpus's size. TOKENS is written under a temporary name and renamed when complete;
TOKENS.json beside it says what it holds (vocabulary, count, sources). An existing TOKENS is
replaced only with --overwrite, and an input never; a file that is not UTF-8 text is refused.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from common.flags import existing_file
from common.outputs import write_outputs
from tools.command_flags import output_file
from tools.output_checks import add_overwrite_flag, check_output_path
from tools.processes import exit_code_of

VOCAB_SIZE = 256  # YOUR TOKENIZER: its vocabulary size
TOKENIZER = "bytes"  # what tools.runs.sample decodes with: "bytes", or the name of yours
CHUNK_BYTES = 1 << 22
# The format common.tokens reads, spelled here because common.tokens imports torch (530 MiB of this command's
# peak); tests/test_token_files.py checks that the two agree.
TOKEN_DTYPE = "<u2"  # one id, a little-endian uint16
MAX_VOCAB_SIZE = 1 << 16


def token_metadata_path(tokens: Path) -> Path:
    """TOKENS.json: what this command writes beside a token file about it."""
    return tokens.with_name(tokens.name + ".json")


def encode(chunk: bytes) -> np.ndarray | list[int]:
    """YOUR TOKENIZER: the ids of a chunk of UTF-8 text. Bytes need no boundaries; a real tokenizer
    should be given whole lines or documents (read them instead of fixed-size chunks)."""
    return np.frombuffer(chunk, dtype=np.uint8)


class NotText(ValueError):
    """A source that is not UTF-8 text: the tokens of a binary file would train on noise."""


def checked_text(source: Path, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` of ``source`` as they come, or ``NotText`` at the first byte that UTF-8 text cannot hold."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for chunk in chunks:
        if b"\0" in chunk:
            raise NotText(f"{source} holds a NUL byte (at byte {offset + chunk.index(0)}): a binary file, not text")
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            raise NotText(f"{source}: not UTF-8 text (byte {offset + err.start})") from None
        offset += len(chunk)
        yield chunk
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise NotText(f"{source}: not UTF-8 text (it ends inside a character)") from None


def read_chunks(source: Path) -> Iterator[bytes]:
    with source.open("rb") as text:
        while chunk := text.read(CHUNK_BYTES):
            yield chunk


def append_ids(sources: list[Path], out: IO[bytes]) -> int:
    """Write every source's token ids to ``out``; returns how many were written."""
    count = 0
    for source in sources:
        for chunk in checked_text(source, read_chunks(source)):
            ids = np.asarray(encode(chunk), dtype=np.int64)
            if ids.size and not 0 <= ids.min() <= ids.max() < VOCAB_SIZE <= MAX_VOCAB_SIZE:
                raise ValueError(
                    f"the tokenizer gave ids {ids.min()} to {ids.max()}, outside 0 to VOCAB_SIZE - 1 "
                    f"({VOCAB_SIZE - 1}), and uint16 holds at most 65535"
                )
            out.write(ids.astype(TOKEN_DTYPE).tobytes())  # little-endian uint16, as --token-file reads it
            count += ids.size
    if count == 0:
        raise ValueError("the text files are empty: no tokens")
    return count


def write_tokens(sources: list[Path], output: Path, overwrite: bool = False) -> int:
    """Write ``output`` and its metadata through common.outputs, as one pair; returns how many tokens it holds.

    Both are complete before either takes its name: a disk that fills on the metadata, or another
    writer that takes a name meanwhile, leaves the earlier pair (if any) as it was, never one file of each.
    """
    counted: list[int] = []

    def metadata(out: IO[bytes]) -> None:
        described = {"tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "dtype": "uint16", "tokens": counted[0]}
        sources_named = {"sources": [str(source) for source in sources]}
        out.write(json.dumps({**described, **sources_named}, indent=1).encode("utf-8"))

    tokens = (output, lambda out: counted.append(append_ids(sources, out)))
    write_outputs([tokens, (token_metadata_path(output), metadata)], overwrite)
    return counted[0]


def source_problem(source: Path) -> str | None:
    """Why ``source`` cannot be read as a text file, or None."""
    if source.is_dir():
        return f"{source} is a folder; give the text files in it (e.g. {source}/*.txt)"
    if not source.exists():
        return f"{source}: no such file"
    if not source.is_file():
        return f"{source} is not a regular file (a device or a pipe); give a text file"
    if not os.access(source, os.R_OK):
        return f"{source}: cannot read it (permission denied)"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runs.prepare_tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "sources", nargs="+", type=existing_file, metavar="TEXT_FILE", help="UTF-8 text files, in order"
    )
    parser.add_argument("--output", type=output_file, required=True, metavar="TOKENS", help="the token file to write")
    add_overwrite_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (main refuses bad text with it later) and the flags, checked before anything is read."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for source in args.sources:
        problem = source_problem(source)
        if problem is not None:
            parser.error(problem)
    check_output_path(parser, args.output, "--output", args.sources, args.overwrite)
    metadata = token_metadata_path(args.output)
    check_output_path(parser, metadata, f"--output {args.output}: its metadata", args.sources, args.overwrite)
    return parser, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    try:
        count = write_tokens(args.sources, args.output, args.overwrite)
    except ValueError as err:  # not text, no text, or YOUR TOKENIZER and VOCAB_SIZE disagree
        parser.error(str(err))
    except OSError as err:  # a full disk, a file that took the name meanwhile (OutputExists)
        print(f"error: could not write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"{args.output}: {count:,} {TOKENIZER} tokens (vocabulary {VOCAB_SIZE}) from {len(args.sources)} file(s)")
    return 0


if __name__ == "__main__":
    # A SIGTERM unwinds as Ctrl-C does, so the output's temporary is removed rather than left behind.
    sys.exit(exit_code_of(main, "python -m tools.runs.prepare_tokens"))
