"""Check that commit subjects follow the house style (docs/development/commit-style.md).

    python tools/check_commits.py [--since REV] [--repo DIR]

Every non-merge commit after ``--since`` (default ``STYLE_SINCE``, the first commit
written in this style; the ones before it are history) must have a subject of the form
``area: imperative summary``, at most 72 characters: ``area`` one or more comma-separated
names of letters, digits, ``_``, ``.``, ``/`` or ``-`` (``pricing``, ``bench/olp``,
``server, docs``), then ``: `` and a summary that does not end in a full stop. The why and
the figures go in the body. Merge commits are not checked (git writes their subjects).
Each problem is printed on its own line with the commit's short hash; exit status 1 if
there is any. A clone that lacks ``--since`` (a shallow one) checks nothing and says so.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

STYLE_SINCE = "fd0c698"
MAX_SUBJECT = 72
SUBJECT = re.compile(r"^[\w./-]+(, [\w./-]+)*: \S.*$")


def subject_problems(subject: str) -> list[str]:
    """What is wrong with one commit subject (nothing when it is in style)."""
    problems = []
    if len(subject) > MAX_SUBJECT:
        problems.append(f"{len(subject)} characters (at most {MAX_SUBJECT})")
    if not SUBJECT.match(subject):
        problems.append("not of the form 'area: imperative summary'")
    elif subject.endswith("."):
        problems.append("ends in a full stop")
    return problems


def has_commit(repo: Path, rev: str) -> bool:
    """Whether ``rev`` names a commit in this clone."""
    return subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=repo,
                          capture_output=True).returncode == 0


def commits_since(repo: Path, since: str) -> list[tuple[str, str]]:
    """(short hash, subject) of every non-merge commit after ``since`` up to HEAD, oldest
    first."""
    out = subprocess.run(["git", "log", "--no-merges", "--reverse", "--format=%h%x00%s",
                          f"{since}..HEAD"],
                         cwd=repo, capture_output=True, text=True, check=True).stdout
    return [(h, s) for h, s in (line.split("\0", 1) for line in out.splitlines() if line)]


def problems(commits: Iterable[tuple[str, str]]) -> list[str]:
    """One line per problem: ``hash: problem: subject``."""
    return [f"{h}: {p}: {s}" for h, s in commits for p in subject_problems(s)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--since", default=STYLE_SINCE, help="check the commits after this one")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)
    if not has_commit(args.repo, args.since):
        print(f"commit subjects: not checked ({args.since} is not in this clone)")
        return 0
    commits = commits_since(args.repo, args.since)
    found = problems(commits)
    for line in found:
        print(line)
    if not found:
        print(f"commit subjects: ok ({len(commits)} commits after {args.since})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
