#!/usr/bin/env python3
"""Every relative link in README.md and docs/*.md points to a file that exists and, with a
#fragment, to a heading of that file (GitHub's anchors: lower case, punctuation dropped,
spaces as hyphens, -1, -2 … for repeats). Links to other sites are not followed.

Pages other work is still writing are listed in PENDING: a link to one of them is reported
as pending, not as broken, while the page is missing. Run by `make lint`; exits 1 naming
every broken link as FILE:LINE: TARGET: what is wrong.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Pages the README links to that are being written elsewhere.
PENDING: set[str] = set()

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(text):
    """(line number, line) outside fenced code blocks, with inline code removed."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", "", line)


def anchors(path):
    """The anchors GitHub gives the headings of a Markdown file."""
    seen = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        title = title.replace("`", "").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


def check(page):
    problems, pending = [], []
    text = page.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            path_part, _, fragment = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            try:
                relative = linked.relative_to(ROOT).as_posix()
            except ValueError:
                problems.append(f"{where}: points outside the repository")
                continue
            if not linked.exists():
                if relative in PENDING:
                    pending.append(f"{where}: pending (being written elsewhere)")
                else:
                    problems.append(f"{where}: no such file")
                continue
            if fragment:
                if linked.suffix != ".md":
                    problems.append(f"{where}: a #fragment on a file that is not Markdown")
                elif fragment not in anchors(linked):
                    problems.append(f"{where}: {relative} has no heading #{fragment}")
    return problems, pending


def main():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems, pending = [], []
    for page in pages:
        p, q = check(page)
        problems += p
        pending += q
    for line in pending:
        print(line)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"check-doc-links: {len(problems)} broken link(s)", file=sys.stderr)
        return 1
    print(f"check-doc-links: the relative links of {len(pages)} pages resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
