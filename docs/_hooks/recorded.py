"""mkdocs hook: publish the recorded experiment plots with the site.

The plots live next to the results they were drawn from (``experiments/recorded/``), not in
``docs/``, so that there is one copy; this hook adds them to the build as ``recorded/...`` and
the experiments page links them by that path.
"""

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDED = ROOT / "experiments"


def on_files(files, config):
    for png in sorted((RECORDED / "recorded").rglob("*.png")):
        uri = png.relative_to(RECORDED).as_posix()
        files.append(File(uri, src_dir=str(RECORDED), dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"]))
    return files
