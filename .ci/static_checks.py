"""Static checks of .ci/run and of the README's contributor notes: `python .ci/static_checks.py`.

1. ruff's F rules (undefined names, unused imports, redefinitions) over every Python tree of the
   repository: must be clean.
2. mypy in its default (basic) mode over jaxmp/: the number of findings may only go down. JAX's
   internal seams (private modules, untyped pytrees) make "clean" a long road, so the count is
   ratcheted against .ci/mypy-baseline.txt; a change that adds a finding fails and names it, a change
   that removes some says to lower the baseline.

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


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def ruff() -> bool:
    done = run([sys.executable, "-m", "ruff", "check", "--select", "F", "--output-format", "concise", *RUFF_TREES])
    print(done.stdout.strip() or done.stderr.strip())
    return done.returncode == 0


def baseline() -> int:
    """The checked-in count: the first integer of the file (the rest is a comment)."""
    return int(re.search(r"\d+", BASELINE.read_text()).group())


def mypy() -> bool:
    done = run([sys.executable, "-m", "mypy", "jaxmp"])
    findings = [line for line in done.stdout.splitlines() if re.match(r"\S+\.py:\d+: error:", line)]
    if done.returncode not in (0, 1) or (done.returncode == 1 and not findings):
        print(done.stdout[-3000:], done.stderr[-3000:])  # mypy itself failed: not a count
        return False
    allowed = baseline()
    print(f"mypy: {len(findings)} findings in jaxmp/ (baseline {allowed}, {BASELINE.relative_to(ROOT)})")
    if len(findings) > allowed:
        print("\n".join(findings))
        print(f"mypy: {len(findings) - allowed} finding(s) more than the baseline: fix the new ones above")
        return False
    if len(findings) < allowed:
        print(f"mypy: {allowed - len(findings)} fewer than the baseline: lower it to {len(findings)} in "
              f"{BASELINE.relative_to(ROOT)} so it stays a ratchet")
    return True


def main() -> int:
    results = {"ruff (F rules)": ruff(), "mypy (ratchet)": mypy()}
    for name, ok in results.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
