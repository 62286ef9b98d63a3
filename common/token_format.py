"""What a token file is on disk, for the command that writes it (tools.runs.prepare_tokens) and the data
that reads it (common.tokens): one definition, importable without torch."""

from __future__ import annotations

from pathlib import Path

TOKEN_DTYPE = "<u2"  # one id, a little-endian uint16
TOKEN_BYTES = 2
# No token file holds an id of a larger vocabulary.
MAX_VOCAB_SIZE = 1 << 16


def token_metadata_path(tokens: Path) -> Path:
    """TOKENS.json: what tools.runs.prepare_tokens writes beside a token file about it."""
    return tokens.with_name(tokens.name + ".json")
