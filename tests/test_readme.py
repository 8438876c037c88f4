"""The README is a landing page: its example runs, its two commands are the documented ones, its
links resolve, and the figures it quotes are the recorded results'."""

import re

import pytest

from _markdown import README, ROOT, python_blocks, run_blocks, section

COMMANDS = (
    "python -m experiments.compare --config=experiments/configs/cpu.py --workdir=/tmp/jaxmp_compare",
    "python -m pytest -n 2 tests",
)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_readme_example_runs():
    blocks = python_blocks(section("Example"))
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 26
    ns = run_blocks(blocks, "README Example")
    assert float(ns["loss"]) < 0.05
    printed = ns["__outputs__"][0]
    # It prints values a reader can read, not reprs: "{'loss_scale': 32768.0, ...}", no "Array(".
    assert "Array(" not in printed and "dtype=" not in printed, printed
    assert re.search(r"'loss_scale': \d+\.\d+, 'last_step_finite': (True|False), 'consecutive_skips': \d+, "
                     r"'total_skips': \d+\}", printed), printed


def test_the_main_jobs_time_has_one_source():
    """README and getting-started quote the main job's time from experiments/recorded/cpu/command_time.json."""
    import json

    timing = json.loads((ROOT / "experiments" / "recorded" / "cpu" / "command_time.json").read_text())
    assert timing["command"] == COMMANDS[0]
    getting_started = (ROOT / "docs" / "getting-started.md").read_text()
    for name, text in (("README.md", README.read_text()), ("docs/getting-started.md", getting_started)):
        flat = " ".join(text.split())
        quiet = re.findall(r"(\d+) s on a quiet", flat)
        busy = re.findall(r"(\d+) s on a busy", flat)
        assert quiet == [str(timing["quiet_s"])] and busy == [str(timing["busy_s"])], (
            f"{name} quotes the main job as {quiet} s quiet / {busy} s busy; "
            f"experiments/recorded/cpu/command_time.json says {timing['quiet_s']} / {timing['busy_s']}")


def test_readme_autocast_example_runs():
    blocks = python_blocks(section("Any JAX function: `jaxmp.autocast`"))
    assert len(blocks) == 1
    ns = run_blocks(blocks, "README autocast")
    assert ns["grads"]["w1"].dtype == ns["jnp"].float32


def test_readme_is_a_landing_page_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    commands = section("The two commands")
    for command in COMMANDS:
        assert command in commands


def test_readme_links_resolve():
    text = README.read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if not t.startswith("http")]
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def test_readme_results_are_the_recorded_ones():
    recorded = (ROOT / "experiments/recorded/cpu/results.md").read_text()
    rows = re.findall(r"^\| (O\d[\w-]*) \| (\S+) \| (\w+) \| ([\d.]+% ± [\d.]+)", section("Result of command 1"), flags=re.M)
    assert len(rows) == 5
    for policy, dtypes, scale, accuracy in rows:
        line = next(l for l in recorded.splitlines() if l.startswith(f"| {policy} |"))
        assert f"| {dtypes} | {scale} |" in line and accuracy in line, (policy, line)
