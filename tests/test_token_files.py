"""Your own text: tools.runs.prepare_tokens, --token-file (read a window at a time) and tools.runs.sample.

The corpora are generated here: random letters, spaces and newlines, 4 and 40 MB of them, written
as byte tokens by tools.runs.prepare_tokens itself.
"""

from __future__ import annotations

import itertools
import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from common.data import IGNORE_INDEX, TokenData, markov_data
from common.distributed import distributed
from common.run_dir import CHECKPOINTS
from common.tokens import text_data, token_file_data
from common.training import TokenCount, global_token_count
from tests.harness.runs import REPO, Run, run_script, run_until_stopped
from tools.runs import prepare_tokens, sample

ALPHABET = b"etaoinshrdlu cmfwypvbgkjqxz\n"
SMALL = ["--block-size", "32", "--heldout-sequences", "20"]
# What a rank's peak memory may grow by for a corpus ten times larger (issue 39's bound for 8 MB to 2 GB).
GROWTH_BOUND = 16 * 2**20


def write_text(path: Path, size: int, seed: int = 0) -> Path:
    letters = np.frombuffer(ALPHABET, dtype=np.uint8)
    np.random.default_rng(seed).choice(letters, size).tofile(path)
    return path


def prepare(text: Path, tokens: Path) -> Path:
    assert prepare_tokens.main([str(text), "--output", str(tokens)]) == 0
    return tokens


def test_prepare_tokens_writes_the_bytes_and_never_replaces_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("héllo\n", encoding="utf-8")
    second.write_text("wörld", encoding="utf-8")
    tokens = tmp_path / "data" / "both.tokens"
    assert prepare_tokens.main([str(first), str(second), "--output", str(tokens)]) == 0
    expected = list("héllo\nwörld".encode())
    assert np.fromfile(tokens, dtype="<u2").tolist() == expected
    metadata = json.loads((tmp_path / "data" / "both.tokens.json").read_text())
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["tokens"]) == ("bytes", 256, len(expected))
    written = tokens.read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        prepare_tokens.main([str(first), "--output", str(tokens)])
    assert refused.value.code == 2 and capsys.readouterr().err.count("exists; choose another name") == 1
    assert tokens.read_bytes() == written
    assert sorted(path.name for path in tokens.parent.iterdir()) == ["both.tokens", "both.tokens.json"]
    # Empty text: refused, and nothing left behind.
    (tmp_path / "empty.txt").touch()
    with pytest.raises(SystemExit) as empty:
        prepare_tokens.main([str(tmp_path / "empty.txt"), "--output", str(tmp_path / "empty.tokens")])
    assert empty.value.code == 2 and "the text files are empty" in capsys.readouterr().err
    assert not (tmp_path / "empty.tokens").exists() and not (tmp_path / "empty.tokens.json").exists()


def test_a_tokenizer_outside_its_vocabulary_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """YOUR TOKENIZER with a VOCAB_SIZE too small for it: an id with no row in the model's embedding."""
    text = tmp_path / "a.txt"
    text.write_text("hello")
    monkeypatch.setattr(prepare_tokens, "VOCAB_SIZE", 100)  # "o" is 111
    with pytest.raises(SystemExit) as refused:
        prepare_tokens.main([str(text), "--output", str(tmp_path / "a.tokens")])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("the tokenizer gave ids 101 to 111, outside 0 to VOCAB_SIZE - 1 (99)") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt"]


def test_a_corpus_ten_times_larger_costs_a_rank_no_more_memory(tmp_path: Path) -> None:
    """The run's own peak memory figure (the process's peak resident set, which is what Slurm's accounting
    reads): a window read is one pread, never a page mapped into the process, and the sampler computes its
    order rather than holding it. At --block-size 8 the 80 MB token file is 5 million windows: a randperm
    of them would be 40 MB a rank, the ids' check through a memory map 80 MB."""
    peaks = {}
    for name, size in (("4MB", 4_000_000), ("40MB", 40_000_000)):
        tokens = prepare(write_text(tmp_path / f"{name}.txt", size), tmp_path / f"{name}.tokens")
        args = ["--token-file", str(tokens), "--max-steps", "5", "--block-size", "8", "--heldout-sequences", "50"]
        run = run_script("ddp/train_transformer.py", args, tmp_path / name, nproc=2).check()
        assert f"{size:,} bytes tokens of {tokens}" in run.output, run.describe()
        peaks[name] = run.final()["peak_memory_bytes"]
    assert peaks["40MB"] - peaks["4MB"] < GROWTH_BOUND, peaks


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("token_file")
    return prepare(write_text(folder / "text.txt", 60_000), folder / "text.tokens")


def history(run: Run) -> list[tuple]:
    return [(record["step"], record["loss"], record["grad_norm"]) for record in run.events("train")]


def test_a_run_on_a_token_file_resumes_exactly_mid_epoch(token_file: Path, tmp_path: Path) -> None:
    """FSDP1 at 2 processes, sharded checkpoints: stopped at a step inside the first epoch (185 steps)."""
    script = "fsdp/train_transformer.py"
    args = [*SMALL, "--token-file", str(token_file), "--max-steps", "16", "--global-batch-size", "10",
            "--log-interval", "1"]  # fmt: skip
    reference = run_script(script, args, tmp_path / "reference", nproc=2).check()
    assert "1,854 train / 20 held-out windows" in reference.output, reference.describe()
    stopped = run_until_stopped(script, args, tmp_path / "stopped", nproc=2, stop_after=6).check()
    assert "stopped at step" in stopped.output, stopped.describe()
    resumed = run_script(script, [*args, "--resume"], tmp_path / "stopped", nproc=2).check()
    assert history(resumed) == history(reference)
    assert resumed.final()["eval_loss"] == reference.final()["eval_loss"]
    state, expected = (torch.load(run.run_dir / "model.pt", weights_only=True) for run in (resumed, reference))
    assert all(torch.equal(state[name], expected[name]) for name in expected)


@pytest.mark.parametrize("data", ["text-file", "token-file"])
def test_sample_continues_a_prompt_in_the_runs_own_text(
    data: str, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = token_file.with_name("text.txt")
    flags = ["--text-file", str(text)] if data == "text-file" else ["--token-file", str(token_file)]
    run_script("ddp/train_transformer.py", [*SMALL, *flags, "--max-steps", "3"], tmp_path).check()
    capsys.readouterr()
    assert sample.main([str(tmp_path), "--prompt", "the ", "--tokens", "40"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("the ") and printed.endswith("\n") and len(printed) > 5, printed
    if data == "text-file":
        # Characters of the training text, one per token.
        continuation = printed[4:-1]
        assert len(continuation) == 40 and set(continuation.encode()) <= set(ALPHABET), printed
        with pytest.raises(SystemExit) as refused:
            sample.main([str(tmp_path), "--prompt", "THE"])
        assert refused.value.code == 2
        assert capsys.readouterr().err.count("--prompt: characters the training text never had: 'EHT'") == 1
    else:
        # Bytes: any text goes in, and what comes out is the UTF-8 its ids spell.
        decoding = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["decoding"]
        assert decoding == {"tokenizer": "bytes"}
        assert sample.decode(sample.encode("héllo, wörld", decoding, 256), decoding) == "héllo, wörld"


# What TOKENS.json or the token file says, and the one line that refuses it (the user's edit, or a
# tokenizer plugged in with the wrong size). Before, each gave a traceback: one an IndexError mid-run.
BAD_TOKEN_FILES = {
    "a vocabulary of a trillion": ({"vocab_size": 10**12}, None, "vocab_size is 1000000000000; it must be a whole"),
    "an empty vocabulary": ({"vocab_size": 0}, None, "vocab_size is 0; it must be a whole number from 1 to 65536"),
    "a word for a vocabulary": ({"vocab_size": "256"}, None, "vocab_size is '256'; it must be a whole number"),
    "no vocabulary": ({"vocab_size": None}, None, "text.tokens.json has no vocab_size"),
    "a vocabulary smaller than its ids": ({"vocab_size": 100}, None, "but text.tokens.json says vocab_size 100"),
    "an id written after prepare": ({}, 300, "holds id 300 (token 1,000), but text.tokens.json says vocab_size 256"),
}


def altered_copy(token_file: Path, folder: Path, written_id: int | None = None, fields: dict | None = None) -> Path:
    """``token_file`` and its .json copied into ``folder``: token 1,000 made ``written_id``, and the .json's
    ``fields`` replaced (a None removes one)."""
    tokens = folder / token_file.name
    ids = np.fromfile(token_file, dtype="<u2")
    if written_id is not None:
        ids[1000] = written_id
    ids.tofile(tokens)
    metadata = {**json.loads(Path(f"{token_file}.json").read_text()), **(fields or {})}
    Path(f"{tokens}.json").write_text(json.dumps({key: value for key, value in metadata.items() if value is not None}))
    return tokens


@pytest.mark.parametrize("case", sorted(BAD_TOKEN_FILES))
def test_a_token_file_that_its_metadata_does_not_describe_is_refused_at_parse_time(
    case: str, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fields, written_id, message = BAD_TOKEN_FILES[case]
    tokens = altered_copy(token_file, tmp_path, written_id, fields)
    parse_args = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]
    with pytest.raises(SystemExit) as refused:
        parse_args(["--token-file", str(tokens), "--run-dir", str(tmp_path / "run"), *SMALL])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and error.count("error:") == 1 and message in error, error


def test_an_id_written_under_a_running_job_stops_before_the_model_reads_it(token_file: Path, tmp_path: Path) -> None:
    """The file changed after the parse-time check (another job rewrote it): the window that holds the id
    stops the rank with the file's name, where the embedding would raise an IndexError (on a GPU, an assert)."""
    tokens = altered_copy(token_file, tmp_path)
    data = token_file_data(tokens, 32, 20)
    ids = np.memmap(tokens, dtype="<u2", mode="r+")
    ids[5 * 32 + 3] = 300  # in the sixth training window, tokens 160 to 192
    ids.flush()
    del ids
    assert data.train[4][1].max() < 256
    with pytest.raises(ValueError, match=f"{tokens} changed under the run: token 163 is id 300, outside its vocab"):
        data.train[5]


def test_text_windows_are_the_texts_characters_in_code_point_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a character-level run trains on: the text as read_text gives it (\\r\\n read as \\n), each character
    numbered by its place in sorted(set(text)), cut into windows of block_size + 1 a block_size apart. The ids
    are read 7 characters at a time, so characters first seen in a later chunk and a \\r\\n split between
    chunks are met; the characters come first in an order other than their code points'."""
    from common.tokens import text_data

    monkeypatch.setattr("common.tokens.TEXT_CHUNK_CHARACTERS", 7)
    pieces = ["😀", "z", "\r\n", "é", "中", " ", "a", "\r", "\n", "Z"]
    text = "".join(pieces[index] for index in np.random.default_rng(0).integers(0, len(pieces), 200))
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode("utf-8"))
    read = path.read_text(encoding="utf-8")
    vocabulary = sorted(set(read))
    ids = torch.tensor([vocabulary.index(character) for character in read])
    block = 5
    data = text_data(path, block)
    assert data.decoding == {"characters": "".join(vocabulary)} and data.vocab_size == len(vocabulary)
    split = int(len(ids) * 0.9)
    for windows, stream in ((data.train, ids[:split]), (data.heldout, ids[split:])):
        assert len(windows) == (len(stream) - 1) // block
        for index in range(len(windows)):
            inputs, targets = windows[index]
            expected = stream[index * block : index * block + block + 1]
            assert inputs.dtype == torch.int64 and torch.equal(inputs, expected[:-1])
            assert torch.equal(targets, expected[1:])


def test_every_windows_targets_are_its_inputs_one_token_on(token_file: Path, tmp_path: Path) -> None:
    """Next-token prediction in every kind of data: a window's target at t is its input at t + 1, over
    block_size tokens (a padded one's over its real tokens). A target two tokens on, read from one token more,
    keeps the window's length and trains a model to predict the token after next: only the targets show it."""
    block = 16
    datasets = {
        "synthetic": markov_data(block, 40, 8),
        "synthetic, variable length": markov_data(block, 40, 8, variable_length=True),
        "text": text_data(write_text(tmp_path / "text.txt", 5_000), block),
        "token file": token_file_data(token_file, block, 20),
    }
    not_one_on = []
    for name, data in datasets.items():
        for split, windows in (("train", data.train), ("held-out", data.heldout)):
            for index in range(len(windows)):
                inputs, targets = windows[index]
                real = int((targets != IGNORE_INDEX).sum())
                if len(inputs) != block or not torch.equal(targets[: real - 1], inputs[1:real]):
                    seen = f"inputs {inputs[:6].tolist()}..., targets {targets[:6].tolist()}..."
                    not_one_on.append(f"{name}, {split} window {index}: {seen}")
                    break
    assert not not_one_on, "targets not the inputs one token on: " + "; ".join(not_one_on)


def test_prepare_tokens_never_imports_torch() -> None:
    """torch's import alone is 530 MiB of a 640 MiB peak on a 1 GB text: the command streams without it."""
    probe = "import sys, tools.runs.prepare_tokens; print([name for name in sys.modules if name.startswith('torch')])"
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]", imported.stdout


def test_prepare_tokens_writes_the_format_that_common_tokens_reads() -> None:
    """The command spells the format itself (common.tokens imports torch): both spellings must agree."""
    from common import tokens

    assert (prepare_tokens.TOKEN_DTYPE, prepare_tokens.MAX_VOCAB_SIZE) == (tokens.TOKEN_DTYPE, tokens.MAX_VOCAB_SIZE)
    path = Path("data/books.tokens")
    assert prepare_tokens.token_metadata_path(path) == tokens.token_metadata_path(path)


def test_a_resumed_run_leaves_the_ids_to_the_windows_it_reads(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A requeue, a restart or a --resume does not read the whole corpus again at its start, as a fresh
    start does: its start read it, and each window is checked as it is read."""
    tokens = altered_copy(token_file, tmp_path, written_id=300)
    run_dir = tmp_path / "run"
    parse_args = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]
    flags = ["--token-file", str(tokens), "--run-dir", str(run_dir), *SMALL, "--resume"]
    with pytest.raises(SystemExit):
        parse_args(flags)  # nothing to resume yet: a fresh start, which reads every id
    assert "holds id 300 (token 1,000)" in capsys.readouterr().err
    (run_dir / CHECKPOINTS).mkdir(parents=True)
    (run_dir / CHECKPOINTS / "step-4.pt").touch()
    assert parse_args(flags)[0].token_file == tokens


def test_a_text_larger_than_memory_allows_is_refused_with_the_way_to_train_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--text-file holds 2 bytes a character in every process; a text that cannot fit is pointed to
    tools.runs.prepare_tokens, which streams it, and --token-file, which reads a window at a time."""
    text = write_text(tmp_path / "text.txt", 60_000)
    monkeypatch.setattr("common.tokens.machine_memory", lambda: 100_000)
    parse_args = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]
    with pytest.raises(SystemExit) as refused:
        parse_args(["--text-file", str(text), "--run-dir", str(tmp_path / "run"), *SMALL])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and error.count("error:") == 1, error
    assert "60,000 characters: their ids would take" in error and "tools.runs.prepare_tokens" in error, error


def test_a_step_knows_its_token_count_only_for_data_that_never_pads(token_file: Path, tmp_path: Path) -> None:
    """TokenCount skips counting only where every target counts: the number it knows is the number counted.
    Data that says nothing of padding is counted (TokenData's default), so a user's own padded data is too."""
    text = write_text(tmp_path / "text.txt", 5_000)
    datasets = {
        "synthetic": markov_data(16, 40, 8),
        "synthetic, variable length": markov_data(16, 40, 8, variable_length=True),
        "text": text_data(text, 16),
        "token file": token_file_data(token_file, 16, 20),
    }
    assert [name for name, data in datasets.items() if data.padded] == ["synthetic, variable length"]
    assert TokenData(datasets["text"].train, datasets["text"].heldout, 2, None, "yours").padded
    with distributed("cpu", timeout_s=60) as ctx:
        for name, data in datasets.items():
            micro_batches = list(itertools.islice(DataLoader(data.train, batch_size=8), 2))
            counted = int(global_token_count(micro_batches, ctx))
            assert int(TokenCount(data.padded, 2 * 8 * 16, ctx)(micro_batches)) == counted, name
