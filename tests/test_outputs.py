"""One way to write an output (common.outputs): whole or not at all, never over an input or a file the run
did not create unless --overwrite says so, and refused before any work when it cannot be written.

The first test is the rule: it reads every module of common/, ddp/ and fsdp/ and fails, naming
file:line, on any call that writes a file anywhere but common/outputs.py. The others are the
defects of issue 37 that broke the rule, each as a user meets it.
"""

from __future__ import annotations

import ast
import errno
import fcntl
import json
import os
import runpy
import signal
import stat
import sys
from pathlib import Path

import pytest
import torch

from common.run_dir import LOCK_FILE
from tests.harness.runs import REPO
from tools import processes
from tools.benchmarks import benchmark, compare_strategies
from tools.checks import comm_check
from tools.processes import exit_code_of
from tools.runs import export_checkpoint, prepare_tokens

SCANNED = ("common", "ddp", "fsdp")
HELPER = "common/outputs.py"
# Calls that write a file whatever their arguments: by function, or by method name on any object.
WRITING_FUNCTIONS = {
    "torch.save",
    "json.dump",
    "pickle.dump",
    "np.save",
    "np.savez",
    "np.savez_compressed",
    "np.savetxt",
    "os.replace",
    "os.rename",
    "os.link",
    "os.symlink",
    "shutil.move",
    "shutil.copy",
    "shutil.copy2",
    "shutil.copyfile",
    "shutil.copytree",
    "SummaryWriter",  # --tensorboard's event files
}
WRITING_METHODS = {
    "write_text",
    "write_bytes",
    "tofile",
    "touch",
    "rename",
    "symlink_to",
    "hardlink_to",
    "savefig",
    "export_chrome_trace",
}
OPENING = {"open", "io.open", "os.fdopen"}  # and any object's .open(): a write if its mode says so
CREATING_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC"}
# Not outputs, with the reason. torch.distributed.checkpoint's dcp.save is torch's own writer for
# sharded checkpoints and is not matched at all: it fills a temporary folder that checkpoint.py
# renames into place through common.outputs.
EXEMPT = {
    ("common/run_dir.py", "os.open"): "the run's lock file: flock needs one inode that every run opens; no result",
    # Appended record by record as metrics.jsonl is, into a folder of their own; never whole files to replace.
    ("common/bookkeeping.py", "SummaryWriter"): "tensorboard's own writer of event files, in RUN_DIR/tensorboard/",
}


def dotted(node: ast.expr) -> str:
    """``a.b.c`` for a name or attribute chain, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else f"?.{node.attr}"
    return ""


def opening_mode(call: ast.Call, name: str) -> str | None:
    """The mode string of an open()-like call, 'r' when none is given, None when it is not a literal."""
    position = 0 if name.endswith(".open") and name not in OPENING else 1
    given = [kw.value for kw in call.keywords if kw.arg == "mode"] or call.args[position : position + 1]
    if not given:
        return "r"
    return given[0].value if isinstance(given[0], ast.Constant) and isinstance(given[0].value, str) else None


def writes_a_file(call: ast.Call) -> str | None:
    """What kind of write ``call`` is, or None."""
    name = dotted(call.func)
    method = name.rsplit(".", 1)[-1]
    if name in WRITING_FUNCTIONS or (name.startswith("?.") or "." in name) and method in WRITING_METHODS:
        return name
    # Path.replace(target) takes one argument; str.replace takes two.
    if method == "replace" and "." in name and name != "os.replace" and len(call.args) == 1:
        return name
    if name in OPENING or (method == "open" and "." in name and name != "os.open"):
        mode = opening_mode(call, name)
        return name if mode is None or set(mode) & set("wax+") else None
    if name == "os.open":
        flags = {node.attr for node in ast.walk(call) if isinstance(node, ast.Attribute)}
        return name if flags & CREATING_FLAGS else None
    return None


def file_writes(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = [(node.lineno, writes_a_file(node)) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return sorted((line, kind) for line, kind in found if kind is not None)


def test_every_file_write_goes_through_common_outputs() -> None:
    offenders = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative == HELPER:
                continue
            offenders += [
                f"{relative}:{line}: {kind}" for line, kind in file_writes(path) if (relative, kind) not in EXEMPT
            ]
    assert not offenders, "files written outside common/outputs.py (use its helpers):\n" + "\n".join(offenders)


def test_the_scan_sees_each_kind_of_write(tmp_path: Path) -> None:
    """The rule's own check: each way of writing a file is found, and reading is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "open(p, 'w')\nPath(p).open('ab')\ntorch.save(x, f)\njson.dump(x, f)\nos.replace(a, b)\n"
        "p.write_text(t)\nids.tofile(f)\np.replace(q)\nos.open(p, os.O_CREAT | os.O_WRONLY)\nopen(p, mode)\n"
        "open(p)\nPath(p).open('rb')\ns.replace('a', 'b')\nos.open(p, os.O_RDONLY)\njson.dumps(x)\n"
    )
    assert [line for line, _ in file_writes(sample)] == list(range(1, 11))


# -- the defects, from the user's side --------------------------------------------------------------


def run_main(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)``'s exit status, whether it returns it or exits, and what it printed."""
    try:
        code = main(argv) or 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    """The single error line of a refusal (and nothing that looks like a traceback)."""
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_prepare_tokens_never_writes_its_metadata_over_an_input(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.json"
    corpus.write_text("some text that the user wants to keep\n")
    code, _, err = run_main(prepare_tokens.main, [str(corpus), "--output", str(tmp_path / "corpus")], capsys)
    assert code == 2 and "is also an input" in one_error(err) and str(corpus) in err
    assert corpus.read_text() == "some text that the user wants to keep\n"
    assert not (tmp_path / "corpus").exists()


def test_prepare_tokens_refuses_text_that_is_not_utf8(tmp_path: Path, capsys) -> None:
    (tmp_path / "latin1.txt").write_bytes("a café in Latin-1".encode("latin-1"))
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    for name, says in [("latin1.txt", "latin1.txt: not UTF-8 text (byte 5)"), ("picture.png", "a binary file")]:
        code, _, err = run_main(prepare_tokens.main, [str(tmp_path / name), "--output", str(tmp_path / "x")], capsys)
        assert code == 2 and says in one_error(err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latin1.txt", "picture.png"]  # nothing left behind


def test_two_prepare_tokens_on_one_output_each_report_their_own(tmp_path: Path, capsys, monkeypatch) -> None:
    """A second writer finishes while the first is mid-way: the file and its count are the second's."""
    first, second, output = tmp_path / "first.txt", tmp_path / "second.txt", tmp_path / "out.tokens"
    first.write_text("a" * 1000)
    second.write_text("b" * 10)
    encode, codes = prepare_tokens.encode, []

    def encode_then_let_the_other_writer_run(chunk: bytes):
        if chunk.startswith(b"a") and not codes:
            codes.append(None)  # the other writer's own chunks come through here too
            codes[0] = prepare_tokens.main([str(second), "--output", str(output)])
        return encode(chunk)

    monkeypatch.setattr(prepare_tokens, "encode", encode_then_let_the_other_writer_run)
    code, out, err = run_main(prepare_tokens.main, [str(first), "--output", str(output)], capsys)
    assert codes == [0] and code == 1, (out, err)
    assert "10 bytes tokens" in out and "1,000" not in out, out  # only the writer whose file it is says so
    assert "appeared while this command ran" in one_error(err)
    assert output.read_bytes() == b"b\x00" * 10
    assert json.loads((tmp_path / "out.tokens.json").read_text())["tokens"] == 10
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == ["first.txt", "out.tokens", "out.tokens.json", "second.txt"]  # no temporary stays


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["book.txt", "--output", "book.txt/x.tokens"], "book.txt is a file, not a folder"),
        (["texts", "--output", "x.tokens"], "texts is a folder"),
    ],
)
def test_prepare_tokens_says_what_is_wrong(tmp_path: Path, capsys, monkeypatch, arguments, says) -> None:
    monkeypatch.chdir(tmp_path)
    Path("book.txt").write_text("text\n")
    Path("texts").mkdir()
    code, _, err = run_main(prepare_tokens.main, arguments, capsys)
    assert code == 2 and says in one_error(err)


def small_run(tmp_path: Path) -> Path:
    """A finished run's files as a training script leaves them: checkpoints/step-2.pt, model.pt, metrics.jsonl."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    optimizer = {"exp_avg": torch.zeros(2048)}  # 8 KiB: a cut beyond torch's first 4 KiB is the case it misnames
    torch.save(
        {"model": {"w": torch.zeros(2)}, "optimizer": optimizer, "trainer": {}}, run / "checkpoints" / "step-2.pt"
    )
    torch.save({"w": torch.ones(2)}, run / "model.pt")
    (run / "metrics.jsonl").write_text(json.dumps({"event": "final", "step": 4}) + "\n")
    return run


def test_export_checkpoint_keeps_a_runs_model_unless_told_to_overwrite(tmp_path: Path, capsys) -> None:
    run = small_run(tmp_path)
    argv = [str(run / "checkpoints" / "step-2.pt"), str(run / "model.pt")]
    code, _, err = run_main(export_checkpoint.main, argv, capsys)
    assert code == 2 and "model.pt exists; choose another name, or pass --overwrite" in one_error(err)
    assert torch.load(run / "model.pt", weights_only=True)["w"].tolist() == [1.0, 1.0]

    code, out, _ = run_main(export_checkpoint.main, [*argv, "--overwrite"], capsys)
    assert code == 0 and "wrote" in out
    assert torch.load(run / "model.pt", weights_only=True)["w"].tolist() == [0.0, 0.0]
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "metrics.jsonl", "model.pt"]


def test_a_truncated_checkpoint_is_called_truncated(tmp_path: Path, capsys) -> None:
    run = small_run(tmp_path)
    step = run / "checkpoints" / "step-2.pt"
    step.write_bytes(step.read_bytes()[:-100])  # a copy that did not finish
    code, _, err = run_main(export_checkpoint.main, [str(step), str(tmp_path / "out.pt")], capsys)
    assert code == 2 and "truncated" in one_error(err) and "Errno" not in err


def test_comm_check_refuses_an_out_it_cannot_create_before_measuring(capsys, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_main(comm_check.parse_args, ["--device", "cpu", "--out", "/proc/foo/x.json"], capsys)
    assert code == 2 and "/proc/foo/x.json: cannot create anything in /proc" in one_error(err)


def fake_training_run(strategy, world_size: int, run_dir: Path, flags: list[str]) -> dict:
    """What a training script does with its run dir, without training: it refuses one that holds a run."""
    if not run_dir.is_absolute():  # launch starts torchrun in the repository, not in this command's folder
        sys.exit(f"error: {run_dir} is relative: the run would write elsewhere than the command reads")
    if (run_dir / "metrics.jsonl").exists():
        sys.exit(f"error: --run-dir {run_dir} already holds an earlier run (metrics.jsonl)")
    record = {"event": "final", "strategy": strategy.name, "world_size": world_size, "peak_memory_bytes": 0}
    record |= {"tokens_per_s": 1.0, "mfu": None, "step_ms": 1.0}
    # The last step's record, which --speedups reads its figures from.
    steps = int(flags[flags.index("--max-steps") + 1])
    train = {"event": "train", "step": steps, "loss": 1.0, "grad_norm": 1.0, "step_ms": 1.0, "tokens_per_s": 1.0}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps(train) + "\n" + json.dumps(record) + "\n")
    return record


def gpu_check_benchmark_flags() -> list[str]:
    """The flags tests/gpu_check.sh gives tools.benchmarks.benchmark."""
    lines = (REPO / "tests/gpu_check.sh").read_text().splitlines()
    commands = [line for line in lines if not line.startswith("#") and "--overhead" not in line]
    (line,) = [line for line in commands if "-m tools.benchmarks.benchmark" in line]
    return line.split("#", 1)[0].split("-m tools.benchmarks.benchmark", 1)[1].split()


def test_a_second_gpu_check_benchmark_replaces_the_first(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(benchmark, "launch", fake_training_run)
    flags = gpu_check_benchmark_flags()
    assert run_main(benchmark.main, flags, capsys)[0] == 0
    first_run = Path("runs/benchmark/gpu-speedups/ddp-0/metrics.jsonl")
    first = first_run.stat().st_ino
    code, out, err = run_main(benchmark.main, flags, capsys)
    assert code == 0, (out, err)
    assert first_run.stat().st_ino != first  # the new run's
    assert sorted(path.name for path in Path("runs/benchmark").iterdir()) == ["gpu-speedups", "gpu-speedups.json"]
    assert len(json.loads(Path("runs/benchmark/gpu-speedups.json").read_text())["runs"]) == 3 * 6


def test_benchmark_run_again_on_one_out_is_refused_up_front(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(benchmark, "launch", fake_training_run)
    argv = ["--nproc", "1", "--out", str(tmp_path / "b.json")]
    assert run_main(benchmark.main, argv, capsys)[0] == 0

    def no_launch(*args) -> None:
        raise AssertionError("launched a run before refusing")

    monkeypatch.setattr(benchmark, "launch", no_launch)
    code, _, err = run_main(benchmark.main, argv, capsys)
    assert code == 2 and "b.json exists; choose another name, or pass --overwrite" in one_error(err)
    (tmp_path / "b.json").unlink()  # the table gone, its runs still there
    code, _, err = run_main(benchmark.main, argv, capsys)
    assert code == 2 and f"an earlier benchmark's runs are in {tmp_path / 'ddp'}" in one_error(err)


def test_compare_strategies_run_again_on_one_out_dir(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(compare_strategies, "launch", fake_training_run)
    monkeypatch.setattr(compare_strategies, "parameter_shapes", lambda run_dir: {})
    monkeypatch.setattr(compare_strategies, "markdown_table", lambda runs, micro_steps: "")
    argv = ["--world-sizes", "1", "--strategies", "ddp", "--out-dir", str(tmp_path / "cmp")]
    assert run_main(compare_strategies.main, argv, capsys)[0] == 0
    code, _, err = run_main(compare_strategies.main, argv, capsys)
    assert code == 2 and "earlier runs are in " + str(tmp_path / "cmp" / "ddp-1") in one_error(err)
    assert run_main(compare_strategies.main, [*argv, "--overwrite"], capsys)[0] == 0
    assert sorted(path.name for path in (tmp_path / "cmp").iterdir()) == ["ddp-1"]


# -- H6's hostile pass: what the rule above still let through ---------------------------------------


def test_overwrite_never_puts_a_file_where_a_pipe_or_device_was(tmp_path: Path, capsys) -> None:
    """``--output /dev/null --overwrite`` as root renamed a file over the system's /dev/null."""
    text, pipe, link = tmp_path / "a.txt", tmp_path / "pipe", tmp_path / "stdout"
    text.write_text("text\n")
    os.mkfifo(pipe)
    link.symlink_to(pipe)  # as /dev/stdout links to /proc/self/fd/1
    for output in (pipe, link):
        code, _, err = run_main(prepare_tokens.main, [str(text), "--output", str(output), "--overwrite"], capsys)
        assert code == 2 and "is not a regular file" in one_error(err)
    assert stat.S_ISFIFO(pipe.stat().st_mode) and link.is_symlink()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "pipe", "stdout"]


def test_an_output_name_as_long_as_the_disk_allows_is_written(tmp_path: Path, capsys) -> None:
    """The temporary's extra parts made a legal name too long, after all the work was done."""
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    run = small_run(tmp_path)
    model = tmp_path / ("m" * (longest - 3) + ".pt")
    code, out, err = run_main(export_checkpoint.main, [str(run / "checkpoints" / "step-2.pt"), str(model)], capsys)
    assert code == 0 and "wrote" in out, err
    (tmp_path / "a.txt").write_text("text\n")
    tokens = tmp_path / ("t" * (longest - len(".json")))  # its metadata, TOKENS.json, just fits
    code, out, err = run_main(prepare_tokens.main, [str(tmp_path / "a.txt"), "--output", str(tokens)], capsys)
    assert code == 0 and tokens.read_bytes() == "text\n".encode("utf-16-le"), err


def test_a_token_file_whose_metadata_name_cannot_exist_is_refused_before_reading(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.txt").write_text("text\n")
    tokens = tmp_path / ("t" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 2))
    code, _, err = run_main(prepare_tokens.main, [str(tmp_path / "a.txt"), "--output", str(tokens)], capsys)
    assert code == 2 and "its metadata" in one_error(err) and "bytes a name may have" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt"]


def test_a_disk_that_fills_on_the_metadata_keeps_the_earlier_token_pair(tmp_path: Path, capsys, monkeypatch) -> None:
    """With --overwrite, the new token file replaced the old one, then the metadata failed: the old token
    file was gone and its metadata stayed, describing a file that was not there."""
    old, new, tokens = tmp_path / "old.txt", tmp_path / "new.txt", tmp_path / "t.tokens"
    old.write_text("old text\n")
    new.write_text("a new and longer text\n")
    assert run_main(prepare_tokens.main, [str(old), "--output", str(tokens)], capsys)[0] == 0
    fsync = os.fsync

    def full_on_the_second_file(fd: int) -> None:  # the metadata's, as a full disk answers at the flush
        if "json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_on_the_second_file)
    code, _, err = run_main(prepare_tokens.main, [str(new), "--output", str(tokens), "--overwrite"], capsys)
    assert code == 1 and "No space left on device" in one_error(err)
    assert tokens.read_bytes() == "old text\n".encode("utf-16-le")
    assert json.loads((tmp_path / "t.tokens.json").read_text())["tokens"] == len("old text\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["new.txt", "old.txt", "t.tokens", "t.tokens.json"]


def test_a_metadata_name_taken_meanwhile_leaves_no_token_file_of_this_run(tmp_path: Path, capsys, monkeypatch) -> None:
    """Another writer takes the metadata's name while prepare_tokens counts: the token file this run had already
    published is removed again, so no token file stands beside metadata that describes another."""
    text, tokens, metadata = tmp_path / "a.txt", tmp_path / "t.tokens", tmp_path / "t.tokens.json"
    text.write_text("some text\n")
    encode = prepare_tokens.encode

    def encode_while_another_writer_takes_the_metadata(chunk: bytes):
        metadata.write_text('{"written by": "another process"}')
        return encode(chunk)

    monkeypatch.setattr(prepare_tokens, "encode", encode_while_another_writer_takes_the_metadata)
    code, _, err = run_main(prepare_tokens.main, [str(text), "--output", str(tokens)], capsys)
    assert code == 1 and "t.tokens.json appeared while this command ran" in one_error(err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "t.tokens.json"]
    assert metadata.read_text() == '{"written by": "another process"}'


def test_a_run_dir_that_links_to_nothing_is_refused_when_parsed(tmp_path: Path, capsys) -> None:
    """It passed the parser, and rank 0 died in mkdir with a FileExistsError traceback."""
    parse_args = runpy.run_path(str(REPO / "ddp/train_mnist.py"))["parse_args"]
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    for run_dir in (link, link / "sub"):
        code, _, err = run_main(parse_args, ["--run-dir", str(run_dir)], capsys)
        assert code == 2 and "is a link to" in one_error(err) and "which does not exist" in err


def stop_by_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` from a shell, while torch writes


def disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() meets on a full disk


@pytest.mark.parametrize(
    ("event", "code", "says"),
    [(stop_by_sigterm, 128 + signal.SIGTERM, "stopped by SIGTERM"), (disk_full, 2, "No space left on device")],
)
def test_export_stopped_or_full_mid_write_says_so_and_leaves_nothing(
    tmp_path: Path, capsys, monkeypatch, event, code, says
) -> None:
    """Either, inside torch.save, came out as torch's 'enforce fail ... unexpected pos' traceback, exit 1."""
    run = small_run(tmp_path)
    opened = Path.open

    def open_then_meet_the_event_at_the_second_write(path: Path, mode: str = "r", *args, **kwargs):
        file = opened(path, mode, *args, **kwargs)
        if not path.name.startswith(".tmp-"):
            return file
        write, writes = file.write, []

        def write_then_meet_it(data) -> int:
            writes.append(len(data))
            if len(writes) == 2:
                event()
            return write(data)

        file.write = write_then_meet_it
        return file

    monkeypatch.setattr(Path, "open", open_then_meet_the_event_at_the_second_write)
    argv = [str(run / "checkpoints" / "step-2.pt"), str(tmp_path / "out.pt")]
    got = exit_code_of(lambda: export_checkpoint.main(argv), "python -m tools.runs.export_checkpoint")
    err = capsys.readouterr().err
    assert got == code and says in err and "Traceback" not in err and "enforce fail" not in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


def test_a_stop_as_a_command_ends_is_no_traceback(tmp_path: Path, capsys, monkeypatch) -> None:
    """A SIGTERM while the command put its signal handlers back raised Stopped out of exit_code_of."""
    (tmp_path / "a.txt").write_text("text\n")
    put_back = signal.signal

    def signal_arriving_while_put_back(signum: int, handler):
        if signum == signal.SIGTERM and handler != processes._SIGNALS.handle:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler is still the command's: it runs now
        return put_back(signum, handler)

    monkeypatch.setattr(processes.signal, "signal", signal_arriving_while_put_back)
    argv = [str(tmp_path / "a.txt"), "--output", str(tmp_path / "t.tokens")]
    code = exit_code_of(lambda: prepare_tokens.main(argv), "python -m tools.runs.prepare_tokens")
    assert code == 0 and (tmp_path / "t.tokens").read_bytes() == "text\n".encode("utf-16-le")


def test_a_folder_made_read_only_mid_write_names_the_temporary_that_stays(tmp_path: Path, capsys, monkeypatch) -> None:
    """``chmod 555`` on the folder mid-way through the tokens (played by refusing its creations and removals:
    chmod does not stop root): the 160 MB temporary stayed, and no line said so."""
    (tmp_path / "a.txt").write_text("text\n")
    out = tmp_path / "out"
    read_only, encode = [], prepare_tokens.encode
    create, unlink = os.open, Path.unlink

    def encode_then_make_read_only(chunk: bytes):
        read_only.append(True)
        return encode(chunk)

    def refused_in_out(path) -> bool:
        return bool(read_only) and Path(path).parent == out

    def open_in_folder(path, flags, *args, **kwargs):
        if refused_in_out(path) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return create(path, flags, *args, **kwargs)

    def unlink_in_folder(path: Path, missing_ok: bool = False) -> None:
        if refused_in_out(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(prepare_tokens, "encode", encode_then_make_read_only)
    monkeypatch.setattr(os, "open", open_in_folder)
    monkeypatch.setattr(Path, "unlink", unlink_in_folder)
    code, _, err = run_main(prepare_tokens.main, [str(tmp_path / "a.txt"), "--output", str(out / "t.tokens")], capsys)
    (left,) = out.iterdir()
    assert code == 1 and "Permission denied" in one_error(err)
    assert f"warning: {left} stays (Permission denied)" in err, err


def test_export_refuses_the_model_of_a_run_that_is_still_writing_it(tmp_path: Path, capsys) -> None:
    """The export was written, then replaced without a word by the run's own model.pt when the run ended."""
    run = small_run(tmp_path)
    (run / "model.pt").unlink()
    step = str(run / "checkpoints" / "step-2.pt")
    with (run / LOCK_FILE).open("w") as lock:  # what a running run holds (common.run_dir)
        lock.write("pid 1 on node-3\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, _, err = run_main(export_checkpoint.main, [step, str(run / "model.pt"), "--overwrite"], capsys)
        assert code == 2 and "a run is writing" in one_error(err) and "pid 1 on node-3" in err
        assert not (run / "model.pt").exists()
        code, out, err = run_main(export_checkpoint.main, [step, str(run / "model-step-2.pt")], capsys)
        assert code == 0 and "wrote" in out, err  # beside the run's files, as the message says
    code, out, err = run_main(export_checkpoint.main, [step, str(run / "model.pt")], capsys)
    assert code == 0 and "wrote" in out, err  # the run has ended


def test_overwrite_never_deletes_a_folder_that_holds_no_run(tmp_path: Path, capsys, monkeypatch) -> None:
    """`benchmark --out b.json --overwrite` in a project whose sources are in ddp/ replaced ddp/ with a run."""
    monkeypatch.chdir(tmp_path)
    for source in ("ddp/train.py", "cmp/ddp-1/notes.txt"):
        Path(source).parent.mkdir(parents=True)
        Path(source).write_text("the user's own file\n")

    def no_launch(*args) -> None:
        raise AssertionError("launched a run before refusing")

    monkeypatch.setattr(benchmark, "launch", no_launch)
    monkeypatch.setattr(compare_strategies, "launch", no_launch)
    runs = (
        (benchmark.main, ["--nproc", "1", "--out", "b.json"], "ddp must hold this command's runs"),
        (compare_strategies.main, ["--world-sizes", "1", "--strategies", "ddp", "--out-dir", "cmp"], "cmp/ddp-1 must"),
    )
    for main, argv, says in runs:
        for overwrite in ([], ["--overwrite"]):
            code, _, err = run_main(main, argv + overwrite, capsys)
            assert code == 2 and says in one_error(err) and "no metrics.jsonl" in err
    assert Path("ddp/train.py").read_text() == Path("cmp/ddp-1/notes.txt").read_text() == "the user's own file\n"


def test_an_output_that_ends_with_a_slash_is_not_written_as_a_file(tmp_path: Path, capsys) -> None:
    """`--output data/` wrote a file named data: Path drops the slash that said a folder was meant."""
    (tmp_path / "a.txt").write_text("text\n")
    for output in ("data/", "data/."):
        argv = [str(tmp_path / "a.txt"), "--output", f"{tmp_path}/{output}"]
        code, _, err = run_main(prepare_tokens.main, argv, capsys)
        assert code == 2 and "is a folder; give the name of the file to write" in one_error(err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt"]


def test_two_benchmarks_on_one_out_the_later_one_says_so(tmp_path: Path, capsys, monkeypatch) -> None:
    """Both pass the check before any run; the one whose ddp run finished second raised OutputExists as a traceback."""
    argv = ["--nproc", "1", "--out", str(tmp_path / "b.json")]
    inner: list[int] = []

    def the_other_benchmark_finishes_first(strategy, world_size: int, run_dir: Path, flags: list[str]) -> dict:
        if not inner:
            inner.append(-1)
            inner[0] = benchmark.main(argv)
        return fake_training_run(strategy, world_size, run_dir, flags)

    monkeypatch.setattr(benchmark, "launch", the_other_benchmark_finishes_first)
    code, _, err = run_main(benchmark.main, argv, capsys)
    assert inner == [0] and code == 1 and "ddp appeared while this command ran" in one_error(err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["b.json", *benchmark.BENCHMARKED]  # no temporary


def test_a_failed_write_leaves_no_folder_it_made(tmp_path: Path, capsys) -> None:
    """`--output new/sub/x.tokens` of a file that is not text left new/sub/ behind, empty."""
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    argv = [str(tmp_path / "latin1.txt"), "--output", str(tmp_path / "new" / "sub" / "x.tokens")]
    code, _, err = run_main(prepare_tokens.main, argv, capsys)
    assert code == 2 and "not UTF-8" in one_error(err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latin1.txt"]
