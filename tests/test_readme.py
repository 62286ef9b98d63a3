"""What the README and the pages in docs/ show must be what the code does."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import torch

from common.bookkeeping import progress_line
from common.training import warmup_cosine
from tests.harness.runs import REPO

EXAMPLE = re.compile(
    r"step (\d+)/(\d+) \| epoch +(\d+) \| loss +([\d.]+) \| grad norm +([\d.]+) \| lr ([\d.e+-]+) \| "
    r"+(\d+) tok/s \| +([\d.]+) ms/step"
)


def test_the_readme_progress_line_is_one_a_default_run_prints() -> None:
    """The format of the example line in docs/running.md ("What a run writes"), and the learning rate
    the default schedule has at its step."""
    lines = [line for line in (REPO / "docs" / "running.md").read_text().splitlines() if EXAMPLE.fullmatch(line)]
    assert len(lines) == 1, "docs/running.md shows one progress line"
    step, total, epoch, loss, norm, lr, rate, step_ms = EXAMPLE.fullmatch(lines[0]).groups()  # type: ignore[union-attr]
    printed = progress_line(
        int(step), int(total), int(epoch), float(loss), float(norm), float(lr), f"{int(rate):9d} tok/s", float(step_ms)
    )
    assert printed == lines[0]

    defaults, _ = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]([])
    assert int(total) == defaults.max_steps
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=defaults.lr)
    schedule = warmup_cosine(optimizer, defaults.warmup_steps, defaults.max_steps, defaults.min_lr_ratio)
    for _ in range(int(step)):
        optimizer.step()
        schedule.step()
    assert f"{schedule.get_last_lr()[0]:.3e}" == lr


FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def documentation_pages() -> list[Path]:
    """Every page a reader follows links through: the front page, docs/ and the harness's own README."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]
    return [page for page in pages if page.exists()]


def prose(page: Path) -> str:
    """A page without its code: a bracket in a code block or a code span is no link."""
    return INLINE_CODE.sub("", FENCED_BLOCK.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """The fragment GitHub gives each heading: lower case, punctuation dropped, spaces as hyphens,
    and a repeated heading numbered from -1."""
    seen: dict[str, int] = {}
    found = set()
    # A code span in a heading keeps its text in the fragment; only its backticks go.
    for heading in HEADING.findall(FENCED_BLOCK.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # a web address: nothing here can reach it
            continue
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (linked.suffix != ".md" or fragment not in anchors(linked)):
            broken.append(f"{target}: no such heading")
    return broken


def test_every_relative_link_and_anchor_resolves() -> None:
    pages = documentation_pages()
    assert REPO / "README.md" in pages
    broken = {str(page.relative_to(REPO)): links for page in pages if (links := broken_links(page))}
    assert not broken, broken


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A heading, with `code`\n")
    page.write_text(
        "# Page\n[ok](other.md#a-heading-with-code) [ok](#page) [gone](missing.md) [no](other.md#nowhere)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
    )
    assert [link.split(":")[0] for link in broken_links(page)] == ["missing.md", "other.md#nowhere"]
