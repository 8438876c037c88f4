"""The README is a landing page: its example runs, its two commands are the documented ones, its
links resolve, and the figures it quotes are the recorded results'."""

import re

import pytest

from tests._support._markdown import README, ROOT, python_blocks, run_blocks, section

COMMANDS = (
    "python -m experiments.compare --config=experiments/configs/cpu.py --workdir=/tmp/jaxmp_compare",
    "python -m pytest -n 2 tests",
)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_readme_quick_start_runs_and_trains():
    # One way in, for any model library: autocast for the compute, loss_scaling for the optimizer.
    blocks = python_blocks(section("Quick start"))
    assert len(blocks) == 2
    setup = blocks[0]
    assert "jaxmp.autocast(loss_fn, \"O1\")" in setup and "jaxmp.loss_scaling(optax." in setup
    # The jaxmp part (the two calls and the step that uses them) fits in under 10 lines.
    code = [l for l in setup.splitlines() if l.strip() and not l.lstrip().startswith("#")
            and not l.startswith(("import", "def loss_fn", "    h ", "    return jnp"))]
    assert len(code) < 10, code
    ns = run_blocks(blocks, "README Quick start")
    assert float(ns["loss"]) < 0.05
    assert ns["params"]["w1"].dtype == ns["jnp"].float32  # the master copy stays float32
    printed = "".join(ns["__outputs__"])
    assert printed.startswith("loss 0.0") and "Array(" not in printed  # values, not reprs


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


def test_readme_lists_every_headline_capability():
    table = section("What is inside")
    for page in ("docs/autocast.md", "docs/concepts.md", "docs/guides/flax-linen.md", "docs/guides/flax-nnx.md",
                 "docs/parallel.md", "docs/lean-recipes.md", "docs/fp8.md", "docs/diagnostics.md",
                 "docs/experiments.md", "docs/guides/sharded-flax.md", "docs/guides/checkpointing.md"):
        assert f"]({page})" in table, page
    assert 'layout="zero"' in table and "master_weights=True" in table
    assert "docs/choose-your-way-in.md" in section("Quick start")


def test_readme_is_a_landing_page_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    commands = re.sub(r"\s*\\\n\s*", " ", section("The two commands"))  # shell continuations joined
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
