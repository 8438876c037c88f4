"""Static checks of .ci/run and of the README's contributor notes: `python .ci/static_checks.py`.

1. ruff's F rules (undefined names, unused imports, redefinitions) and its line length (E501, at
   pyproject.toml's ``line-length``) over every Python tree of the repository: must be clean.
2. mypy in its default (basic) mode over jaxmp/: the number of findings may only go down. JAX's
   internal seams (private modules, untyped pytrees) make "clean" a long road, so the count is
   ratcheted against .ci/mypy-baseline.txt; a change that adds a finding fails and names it, a change
   that removes some says to lower the baseline. Some categories are held at 0 on their own
   (`ZERO_CATEGORIES`): an undefined name is a bug that ships (the NNX door's O0 NameError), so
   one such finding fails even while the total stays under the baseline.

Exit status 0 when both hold.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUFF_TREES = ["jaxmp", "experiments", "benchmarks", "tests", ".ci"]
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
#: mypy error codes no change may add, whatever the total: each finding of these fails the check.
ZERO_CATEGORIES = ("name-defined",)


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def ruff(rules: str = "F") -> bool:
    done = run([sys.executable, "-m", "ruff", "check", "--select", rules, "--output-format", "concise", *RUFF_TREES])
    print(done.stdout.strip() or done.stderr.strip())
    return done.returncode == 0


def baseline() -> int:
    """The checked-in count: the first integer of the file (the rest is a comment)."""
    return int(re.search(r"\d+", BASELINE.read_text()).group())


def judge(findings: list[str], allowed: int) -> tuple[bool, list[str]]:
    """Whether mypy's findings pass the ratchet, and what to print.

    Args:
      findings: mypy's error lines (``path.py:12: error: message  [code]``).
      allowed: the baseline count.

    Returns:
      ``(ok, lines)``: ok when no finding is of a zero category and the count is within the baseline.

    Example:
      >>> judge(['a.py:1: error: Name "x" is not defined  [name-defined]'], 76)[0]
      False
    """
    zero = [f for f in findings if re.search(r"\[(%s)\]\s*$" % "|".join(map(re.escape, ZERO_CATEGORIES)), f)]
    lines = [f"mypy: {len(findings)} findings in jaxmp/ (baseline {allowed}, {BASELINE.relative_to(ROOT)})"]
    if zero:
        lines += [*zero, f"mypy: {len(zero)} finding(s) of a category held at 0 ({', '.join(ZERO_CATEGORIES)}), "
                  "whatever the total: fix them"]
    if len(findings) > allowed:
        lines += [*findings, f"mypy: {len(findings) - allowed} finding(s) more than the baseline: fix the new ones above"]
    elif len(findings) < allowed:
        lines.append(f"mypy: {allowed - len(findings)} fewer than the baseline: lower it to {len(findings)} in "
                     f"{BASELINE.relative_to(ROOT)} so it stays a ratchet")
    return not zero and len(findings) <= allowed, lines


def mypy() -> bool:
    done = run([sys.executable, "-m", "mypy", "jaxmp"])
    findings = [line for line in done.stdout.splitlines() if re.match(r"\S+\.py:\d+: error:", line)]
    if done.returncode not in (0, 1) or (done.returncode == 1 and not findings):
        print(done.stdout[-3000:], done.stderr[-3000:])  # mypy itself failed: not a count
        return False
    ok, lines = judge(findings, baseline())
    print("\n".join(lines))
    return ok


def main() -> int:
    results = {"ruff (F rules)": ruff(), "ruff (line length)": ruff("E501"), "mypy (ratchet)": mypy()}
    for name, ok in results.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
