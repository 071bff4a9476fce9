"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a
missing page or an API reference that does not resolve fails it), the README stays a
front door, its quick-start commands are the ones CI runs, and the figure script runs.

The code blocks themselves are run by tests/test_docs_examples.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = re.compile(r"^```bash\n(.+?)\n```", re.MULTILINE)


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    config = str(ROOT / "mkdocs.yml")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(site)]
    built = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    front = (site / "index.html").read_text()
    assert "mhsa.attention" in front
    api = (site / "api" / "attention" / "index.html").read_text()
    assert "Scaled dot-product attention" in api  # the docstring, rendered by mkdocstrings
    assert (site / "images" / "block_plan.svg").is_file()


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def quick_start_commands(page: Path) -> list[str]:
    return QUICK_START.findall(page.read_text().split("## Example")[0])


def test_the_readme_test_command_is_what_ci_runs():
    chat, tests = quick_start_commands(ROOT / "README.md")[:2]
    assert "mhsa chat" in chat and "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == tests, "README's test command and .ci/run's last line differ"
    install = (ROOT / "docs" / "install.md").read_text()
    assert chat in install and tests in install, "docs/install.md repeats both, verbatim"


@pytest.mark.slow
def test_block_plan_figure_script_runs(tmp_path):
    out = tmp_path / "plan.svg"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = ROOT / "tools" / "plot_block_plan.py"
    command = [sys.executable, str(script), str(out)]
    ran = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    svg = out.read_text()
    assert "visited 50% of L x S" in svg  # causal L = S: half the tiles' area


def test_the_home_page_links_every_guide():
    """docs/index.md is the map of the site: every page of mkdocs.yml's nav (the API
    reference aside, which has its own index) is linked from it."""
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = {page for page in nav if not page.startswith("api/") and page != "index.md"}
    linked = set(re.findall(r"\]\(([\w./-]+\.md)", (ROOT / "docs" / "index.md").read_text()))
    assert pages - linked == set(), f"docs/index.md leaves out {sorted(pages - linked)}"
