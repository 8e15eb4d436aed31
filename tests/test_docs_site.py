"""The documentation site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict``:
no page left out of the nav, no link to a page or an anchor that does not exist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 180


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's banner is no warning of ours
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )


def test_the_docs_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "design" / "dra-gpu-sets" / "index.html").is_file()


def test_the_strict_build_refuses_an_orphan_page_a_broken_link_and_a_missing_anchor(
    tmp_path: Path,
) -> None:
    # the same site with three mistakes: the validation settings of mkdocs.yml must catch each
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")
    with (tmp_path / "docs" / "index.md").open("a", encoding="utf-8") as page:
        page.write("\n[gone](no-such-page.md) [nowhere](labels.md#no-such-heading)\n")
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "orphan.md" in output
    assert "no-such-page.md" in output
    assert "no-such-heading" in output
