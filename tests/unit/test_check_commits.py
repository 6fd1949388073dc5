"""tools/check_commits.py: subjects in the house style pass, others are reported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from check_commits import main, subject_problems


@pytest.mark.parametrize("subject", [
    "house: lay the package out by concept",
    "bench/olp, docs: render the table from its results file",
    "pricing.book: name the running sums",
])
def test_subjects_in_style_pass(subject: str) -> None:
    assert subject_problems(subject) == []


@pytest.mark.parametrize(("subject", "problem"), [
    ("README: " + "x" * 70, "78 characters (at most 72)"),
    ("Fix the thing", "not of the form 'area: imperative summary'"),
    ("area:no space", "not of the form 'area: imperative summary'"),
    ("docs: end with a stop.", "ends in a full stop"),
])
def test_subjects_out_of_style_are_reported(subject: str, problem: str) -> None:
    assert problem in subject_problems(subject)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_only_commits_after_since_are_checked(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _git(tmp_path, "init", "-q")
    for subject in ("An old paragraph-long subject from before the style was written down",
                    "docs: write the commit style down", "Bad subject"):
        _git(tmp_path, "commit", "-q", "--allow-empty", "-m", subject)
    first = _git(tmp_path, "rev-list", "--max-parents=0", "HEAD")
    assert main(["--repo", str(tmp_path), "--since", first]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].endswith(": Bad subject")
    second = _git(tmp_path, "rev-parse", "HEAD~1")
    _git(tmp_path, "commit", "-q", "--amend", "--allow-empty", "-m", "docs: fix the subject")
    assert main(["--repo", str(tmp_path), "--since", second]) == 0
    assert "ok (1 commits after" in capsys.readouterr().out


def test_a_clone_without_since_checks_nothing_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "Bad subject")
    assert main(["--repo", str(tmp_path), "--since", "0" * 40]) == 0
    assert "not checked" in capsys.readouterr().out
