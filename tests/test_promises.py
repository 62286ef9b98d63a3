"""A sentence of the docs that promises a behaviour names the test that checks it.

The name is an HTML comment right after the sentence, which GitHub does not show:

    ... is refused with one message. <!-- test: tests/test_bad_input.py::test_bad_flag_is_refused -->

One comment per sentence, holding one or more test ids (``FILE::FUNCTION``, or ``FILE::CLASS::METHOD``)
separated by spaces; a parametrized id (``test_x[case]``) counts as its function. A sentence is taken
for a promise when it uses the words of ``PROMISE`` below; one that does and names no test fails this
file with its page and line, so a promise gets its test the day it is written. Prose and list items
are read; code, headings, tables (summaries of what their page's prose says, and measurements) and
each page's opening paragraph (the summary of what follows) are not.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.harness.runs import REPO

MARKER = re.compile(r"<!-- test: (.*?) -->", re.DOTALL)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
FENCED_BLOCK = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.MULTILINE | re.DOTALL)  # in list items too
INLINE_CODE = re.compile(r"`[^`\n]*`")
BLOCK_START = re.compile(r"\s*(?:[-*]|\d+\.) ")
# A sentence ends at . ! or ? before a space or the end of its paragraph; the markers after it are its own.
SENTENCE = re.compile(r"\S.*?(?:[.!?][)*]*(?=\s|\Z)(?:\s*<!--.*?-->)*|\Z)", re.DOTALL)

# The words a promise about this project's behaviour is made of, tuned on these pages: each word
# below caught promises there; "once", "exactly" and "counts once" alone caught mostly measurements
# and explanations, so they count only in the phrases below.
PROMISE = re.compile(
    r"\b(?:never|always|refus(?:e|es|ed|al)|atomic(?:ally)?|bit for bit|bit-identical|uninterrupted|tested"
    r"|says (?:so|how many|when)|names each|names (?:it|them)|naming|one (?:message|line|report)|exit code \d"
    r"|exits? with (?:code )?\d|left behind|kills? every|delet(?:e|es|ed)|before any\w*)\b"
    r"|\(exit \d\)"
    r"|\b(?:continues?|resumes?|resumed)\b[^.]{0,30}\bexactly\b"
    r"|\b(?:every \w+|printed|reported|shown|appears?) once\b"
    r"|\bnothing (?:\w+ ){0,3}(?:is |was )?(?:lost|written|deleted|overwritten|replaced|hangs|touched|unpickled)\b",
    re.IGNORECASE,
)

# Sentences the words above catch that promise nothing this project's code does: (page, words of the
# sentence) -> why.
NOT_A_PROMISE: dict[tuple[str, str], str] = {
    ("docs/checkpoints.md", "torchrun does not pass SIGUSR1 on unless"): "torchrun's behaviour, not this code's",
    ("docs/communication.md", "`NCCL_NET_GDR_LEVEL`: the largest"): "what an NCCL setting means",
    ("docs/performance.md", "A GPU runs ahead of the host only while"): "how a GPU works",
    ("docs/performance.md", "FSDP1 never frees its root after forward"): "what torch's FSDP1 does",
    ("docs/slurm.md", "But a job that ends by itself within its"): "SLURM's behaviour, tried by hand",
    ("docs/slurm.md", "Its partitions: `debug` (the default, never"): "the local cluster's configuration",
    ("docs/torch-versions.md", "both ends of that range are tested"): "what .ci/run runs, not what the code does",
    ("docs/torch-versions.md", "Releases between the two ends are not tested"): "what CI leaves out",
    (
        "docs/troubleshooting.md",
        "Every promise here is tested from the user's",
    ): "points at the markers of the sentences below",
    ("docs/your-own-project.md", "Keep `DistributedSampler` with `set_epoch`"): "advice to whoever copies a script",
    ("tests/README.md", "So the launchers' own contract is tested"): "says which tests use the real launchers",
}

# Promises that no test checks yet: (page, words of the sentence). Mark each with its test once there
# is one, and take it off this list.
NO_TEST_YET: set[tuple[str, str]] = {
    ("docs/checkpoints.md", "no rank holds more than the one copy rank 0 read"),
    ("docs/checkpoints.md", "SIGTERM to torchrun itself stops the run cleanly too"),
    ("docs/communication.md", "It says when the check ran on one node"),
    ("docs/communication.md", "writes it to `--out` as JSON (atomically)"),
    ("docs/equivalence.md", "the band never goes below the error of torch's norm"),
    ("docs/running.md", "are held out and never train"),
    ("docs/slurm.md", "`PreemptMode=CANCEL` was tried by hand"),
    ("docs/slurm.md", "Without SLURM installed these tests skip"),
    ("docs/troubleshooting.md", "on a file system without locks the run says so"),
    ("tests/README.md", "a hard timeout that kills every process it started"),
}


@dataclass(frozen=True)
class Sentence:
    page: str
    line: int
    words: str  # as written, without its comments, on one line
    test_ids: tuple[str, ...]
    promises: bool

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.words[:100]}"


def documentation_pages() -> list[Path]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]
    return [page for page in pages if page.exists()]


def without_code(text: str) -> str:
    """The page with each code block blanked and each code span's text masked, at the same offsets:
    a word or a period in code is neither a promise nor the end of a sentence."""
    text = FENCED_BLOCK.sub(lambda block: re.sub(r"[^\n]", " ", block.group()), text)
    return INLINE_CODE.sub(lambda span: "`" + "x" * (len(span.group()) - 2) + "`", text)


def paragraphs(text: str) -> Iterator[tuple[int, int]]:
    """The start and end offsets of each paragraph and list item of prose, after the page's first."""
    start, offset, seen = None, 0, 0
    for line in text.split("\n"):
        ends_one = not line.strip() or line.startswith(("#", "|")) or BLOCK_START.match(line)
        if ends_one and start is not None:
            seen += 1
            if seen > 1:
                yield start, offset - 1
            start = None
        if start is None and line.strip() and not line.startswith(("#", "|")):
            start = offset
        offset += len(line) + 1
    if start is not None and seen > 0:
        yield start, len(text)


def sentences(page: Path) -> list[Sentence]:
    text = page.read_text()
    masked = without_code(text)
    name = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else page.name
    return [
        sentence_of(name, text, masked, match)
        for start, end in paragraphs(masked)
        for match in SENTENCE.finditer(masked, start, end)
    ]


def sentence_of(page: str, text: str, masked: str, match: re.Match[str]) -> Sentence:
    # Comments are found in the masked text, so that one quoted in a code span is no marker.
    comments = list(COMMENT.finditer(masked, match.start(), match.end()))
    bounds = [match.start(), *(offset for comment in comments for offset in comment.span()), match.end()]
    words = "".join(text[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2))
    return Sentence(
        page=page,
        line=text.count("\n", 0, match.start()) + 1,
        words=" ".join(words.split()),
        test_ids=tuple(
            test_id for comment in comments for marker in MARKER.findall(comment.group()) for test_id in marker.split()
        ),
        # On one line, so that a phrase of PROMISE broken across two lines still reads as one.
        promises=bool(PROMISE.search(" ".join(COMMENT.sub("", match.group()).split()))),
    )


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """The test functions of a file, and the test methods of its classes as CLASS::METHOD."""
    if not path.is_file():
        return frozenset()
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
    return frozenset(name for name in names if name.split("::")[-1].startswith("test"))


def names_a_test(test_id: str, root: Path = REPO) -> bool:
    file, _, name = test_id.partition("::")
    return file.startswith("tests/") and name.split("[")[0] in defined_tests(root / file)


def missing_tests(found: list[Sentence], root: Path = REPO) -> list[str]:
    return [
        f"{sentence.where()} -> {test_id}"
        for sentence in found
        for test_id in sentence.test_ids
        if not names_a_test(test_id, root)
    ]


def unmarked_promises(found: list[Sentence], known: set[tuple[str, str]]) -> list[Sentence]:
    return [
        sentence
        for sentence in found
        if sentence.promises
        and not sentence.test_ids
        and not any(page == sentence.page and words in sentence.words for page, words in known)
    ]


def all_sentences() -> list[Sentence]:
    return [sentence for page in documentation_pages() for sentence in sentences(page)]


def test_every_marker_names_a_test_that_exists() -> None:
    found = all_sentences()
    assert sum(len(sentence.test_ids) for sentence in found) > 0, "no marker found: the parser is broken"
    missing = missing_tests(found)
    assert not missing, "markers naming no test:\n" + "\n".join(missing)


def test_every_promise_names_its_test() -> None:
    unmarked = unmarked_promises(all_sentences(), set(NOT_A_PROMISE) | NO_TEST_YET)
    assert not unmarked, "promise sentences without <!-- test: tests/FILE.py::TEST --> after them:\n" + "\n".join(
        sentence.where() for sentence in unmarked
    )


def test_every_exception_still_matches_one_unmarked_promise() -> None:
    """An entry of NOT_A_PROMISE or NO_TEST_YET whose sentence changed, or got its marker, goes."""
    found = [sentence for sentence in all_sentences() if sentence.promises and not sentence.test_ids]
    stale = [
        entry
        for entry in [*NOT_A_PROMISE, *sorted(NO_TEST_YET)]
        if sum(entry[0] == sentence.page and entry[1] in sentence.words for sentence in found) != 1
    ]
    assert not stale, stale


def test_the_check_finds_a_missing_test_and_an_unmarked_promise(tmp_path: Path) -> None:
    """And reads no promise in code, a table or a page's summary, and no marker quoted in code."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text(
        "def test_here():\n    pass\n\nclass TestGroup:\n    def test_in(self):\n        pass\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nThe summary, which never counts.\n\n"
        "A bad flag is refused. <!-- test: tests/test_real.py::test_here[case]\n"
        "tests/test_real.py::TestGroup::test_in -->\n"
        "A run never deletes a checkpoint. <!-- test: tests/test_real.py::test_gone -->\n\n"
        "- a second list item that says `never` in code only;\n"
        "- a list item that quotes `<!-- test: tests/test_real.py::test_quoted -->` and is never marked;\n"
        "- a list item that is refused\n  on its second line\n\n"
        "| a table | that is never read |\n\n"
        "```\nnever in a code block.\n```\n"
        "The weights are never saved. A failed run stops (exit\n1), with every step\nonce.\n"
    )
    found = sentences(page)
    assert [line.split(" -> ")[1] for line in missing_tests(found, tmp_path)] == ["tests/test_real.py::test_gone"]
    assert [(sentence.line, sentence.words) for sentence in unmarked_promises(found, set())] == [
        (10, "- a list item that quotes `<!-- test: tests/test_real.py::test_quoted -->` and is never marked;"),
        (11, "- a list item that is refused on its second line"),
        (19, "The weights are never saved."),
        (19, "A failed run stops (exit 1), with every step once."),
    ]
    assert [sentence.line for sentence in unmarked_promises(found, {("page.md", "weights are never")})] == [10, 11, 19]
