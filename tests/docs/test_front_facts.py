"""The front of the docs says each fact once, with the figure the code gives (issue 60, items 11
and 13): the lean recipes' count and bytes from `jaxmp.lean.PRESETS`, every preset family named
where presets are listed (the fp8 and block-scaled ones told on docs/fp8.md), a Documentation row
for every page "What is inside" points to, and one float32-master reference row per job."""

import re

from jaxmp import lean
from jaxmp._precision._presets import PRESET_NAMES
from tests._support._markdown import ROOT, page, section

README = ROOT / "README.md"
WORDS = {n: w for n, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}
REFERENCE = "fp32-masters"


def _flat(text):
    return " ".join(text.split())


def _bytes(value):
    return f"{value:.2f}".rstrip("0").rstrip(".")


def test_lean_recipe_count_and_bytes_are_the_presets_on_readme_and_home():
    lean_names = [n for n in lean.PRESETS if n != REFERENCE]
    top, low = lean.PRESETS[REFERENCE][0], min(b for b, _ in lean.PRESETS.values())
    readme = _flat(section("What is inside"))
    assert (f"{WORDS[len(lean_names)]} recipes beside the float32-master reference, "
            f"from {_bytes(top)} down to {_bytes(low)} bytes") in readme, readme
    home = _flat(section("What is inside", page("index.md")))
    # the home page names one recipe, then the rest
    assert (f"and {WORDS[len(lean_names) - 1]} more beside the float32-master reference: "
            f"from {_bytes(top)} down to {_bytes(low)} bytes") in home, home


def test_lean_recipes_table_is_presets_nominal_figures_and_the_measured_ones_say_so():
    text = page("lean-recipes.md").read_text()
    rows = dict(re.findall(r'^\| `"([\w-]+)"` \| ([\d.]+) \| ', text.split("\n## ", 1)[0], flags=re.M))
    assert rows == {name: _bytes(b) for name, (b, _) in lean.PRESETS.items()}, rows
    # Wherever the page quotes PRESETS' figures, they are PRESETS' own (3.0625, never 3.07).
    flat = _flat(text)
    quoted = re.findall(r"nominal `PRESETS` figures? ([\d., and]+)", flat)
    assert quoted, "the measured bytes are no longer set against PRESETS' nominal figures"
    exact = {repr(b) for b, _ in lean.PRESETS.values()}
    for figures in quoted:
        for value in re.findall(r"\d+\.\d+", figures):
            assert value in exact, (value, figures)


def test_one_float32_master_reference_row_per_job_or_the_page_says_why():
    text = page("lean-recipes.md").read_text()
    mlp = re.findall(r"^\| fp32-masters (?:\(reference\)|\(14 B\)) \| ([^\n]+)$", text, flags=re.M)
    assert len(mlp) == 2 and mlp[0] == mlp[1], mlp  # the tanh MLP: one figure in both tables
    main = re.findall(r"^\| fp32-masters \| 14 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text, flags=re.M)
    if len(set(main)) > 1:  # two rows for one job: the page says why they differ
        assert "Two caveats on this table's own float32-master row" in text


def test_readme_documentation_rows_cover_every_page_what_is_inside_points_to():
    inside = set(re.findall(r"\]\((docs/[^)#\s]+)", section("What is inside")))
    documented = set(re.findall(r"\]\((docs/[^)#\s]+)", section("Documentation")))
    for must in ("docs/fp8.md", "docs/lean-recipes.md", "docs/debugging.md"):
        assert must in documented, must
    assert inside <= documented, sorted(inside - documented)


def test_every_preset_family_is_named_where_presets_are_listed_and_fp8_told_once():
    table = next(t for t in page("concepts.md").read_text().split("\n\n") if t.startswith("| name | params |"))
    listed = set(re.findall(r"`([\w-]+)`", table))
    for name in PRESET_NAMES:
        base = re.sub(r"-(bf16|fp16)$", "", name)
        assert name in listed or base in listed, name
    concepts = _flat(page("concepts.md").read_text())
    assert "[fp8 training](fp8.md)" in concepts
    fp8 = [n for n in PRESET_NAMES if re.search(r"fp8|fp4", n)]
    readme = _flat(README.read_text())
    home = _flat(page("index.md").read_text())
    for name in fp8:
        assert f'"{name}"' in readme and f'"{name}"' in home, name
    assert "](docs/fp8.md)" in section("What is inside") and "](fp8.md)" in section("What is inside", page("index.md"))
