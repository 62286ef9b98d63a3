"""Turn text files into one flat file of token ids, for the transformer scripts' --token-file.

    python -m common.prepare_tokens book1.txt book2.txt --output data/books.tokens
    torchrun --standalone --nproc_per_node=4 fsdp/train_transformer_fsdp2.py --token-file data/books.tokens

The tokens are the text's bytes: every byte of the UTF-8 text is one token, a vocabulary of 256, so
no tokenizer package is needed and any text (any language, any symbols) works. A real tokenizer
gives shorter sequences for the same text: replace ``encode`` and ``VOCAB_SIZE`` below (YOUR
TOKENIZER), for example with tiktoken's ``get_encoding("gpt2").encode_ordinary`` and 50257, or a
sentencepiece model's ``encode`` and its vocabulary size. Ids are stored as uint16, so up to 65536.

The files are read a chunk at a time and the ids appended as they come, so memory stays the same
whatever the corpus's size. TOKENS is written under a temporary name and renamed when complete;
TOKENS.json beside it says what it holds (vocabulary, count, sources). An existing TOKENS is never
replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from common.tokens import token_metadata_path

VOCAB_SIZE = 256  # YOUR TOKENIZER: its vocabulary size
TOKENIZER = "bytes"  # what common.sample decodes with: "bytes", or the name of yours
CHUNK_BYTES = 1 << 22


def encode(chunk: bytes) -> np.ndarray | list[int]:
    """YOUR TOKENIZER: the ids of a chunk of UTF-8 text. Bytes need no boundaries; a real tokenizer
    should be given whole lines or documents (read them instead of fixed-size chunks)."""
    return np.frombuffer(chunk, dtype=np.uint8)


def write_tokens(sources: list[Path], output: Path) -> int:
    """Append every source's token ids to ``output``; returns how many were written."""
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp")
    count = 0
    try:
        with temporary.open("wb") as out:
            for source in sources:
                with source.open("rb") as text:
                    while chunk := text.read(CHUNK_BYTES):
                        ids = np.asarray(encode(chunk), dtype=np.int64)
                        if ids.size and not 0 <= ids.min() <= ids.max() < VOCAB_SIZE <= 1 << 16:
                            raise ValueError(
                                f"the tokenizer gave ids {ids.min()} to {ids.max()}, outside 0 to VOCAB_SIZE - 1 "
                                f"({VOCAB_SIZE - 1}), and uint16 holds at most 65535"
                            )
                        ids.astype("<u2").tofile(out)  # little-endian uint16, as --token-file reads it
                        count += ids.size
            out.flush()
            os.fsync(out.fileno())
        described = {"tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "dtype": "uint16", "tokens": count}
        sources_named = {"sources": [str(source) for source in sources]}
        token_metadata_path(output).write_text(json.dumps({**described, **sources_named}, indent=1))
        os.replace(temporary, output)
    finally:
        temporary.unlink(missing_ok=True)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, metavar="TEXT_FILE", help="UTF-8 text files, in order")
    parser.add_argument("--output", type=Path, required=True, metavar="TOKENS", help="the token file to write")
    args = parser.parse_args(argv)
    for source in args.sources:
        if not source.is_file():
            parser.error(f"{source}: no such file")
    if args.output.exists():
        parser.error(f"--output {args.output} exists; choose another name, or delete it first")
    try:
        count = write_tokens(args.sources, args.output)
    except OSError as err:
        print(f"error: could not write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    except ValueError as err:  # YOUR TOKENIZER and VOCAB_SIZE disagree: an id the model has no row for
        parser.error(str(err))
    if count == 0:
        args.output.unlink()
        token_metadata_path(args.output).unlink()
        parser.error("the text files are empty: no tokens")
    print(f"{args.output}: {count:,} {TOKENIZER} tokens (vocabulary {VOCAB_SIZE}) from {len(args.sources)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
