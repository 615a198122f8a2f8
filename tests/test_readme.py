"""The README says what the registry and the Makefile hold: its tables are checked against them."""
import os
import re
import subprocess
import sys

from Utils.ladder.__main__ import markdown
from Utils.ladder.registry import RUNGS

from conftest import MAKE_VARIABLES, REPO_ROOT, clean_env

README = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()


def test_the_additions_table_is_the_registry():
    block = re.search(r"<!-- additions: python -m Utils.ladder markdown -->\n(.*?)\n<!-- /additions -->", README,
                      re.DOTALL)
    assert block, "README.md lost its additions table's markers"
    assert block.group(1) == markdown(), "README.md's additions table differs: paste `python -m Utils.ladder markdown`"


def test_the_ladder_table_names_every_rung_and_its_script():
    rows = re.findall(r"^\| `([\w]+)` \| `([\w.-]+\.py)` \|", README, re.MULTILINE)
    assert rows == [(r.name, r.script) for r in RUNGS.values()]
    for rung in RUNGS.values():
        assert os.path.isfile(os.path.join(REPO_ROOT, rung.script))


def test_every_target_the_readme_names_is_in_make_help():
    help_text = subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "help"], cwd=REPO_ROOT,
                               env=clean_env(), capture_output=True, text=True, timeout=60).stdout
    named = set(re.findall(r"`make (\w[\w-]*)", README)) | {"install", "all", "test", "custom", "gpu-test"}
    missing = sorted(t for t in named - {"help"} if f"make {t}" not in help_text and t not in RUNGS)
    assert not missing, f"make help does not list {missing}"


def test_make_help_names_every_variable_make_passes_on():
    help_text = subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "help"], cwd=REPO_ROOT,
                               env=clean_env(), capture_output=True, text=True, timeout=60).stdout
    with open(os.path.join(REPO_ROOT, "Makefile")) as f:
        exported = re.findall(r"^export ([A-Z_ ]+)$", f.read(), re.M)
    taken = set(MAKE_VARIABLES) - {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"} | {v for line in exported for v in line.split()}
    missing = sorted(v for v in taken if not re.search(rf"\b{v}=", help_text))
    assert not missing, f"make help does not name {missing}"


def test_the_benchmarks_contents_link_every_section_and_every_link_lands():
    # GitHub's anchor for a heading: lower case, punctuation dropped but for - and _, spaces as -.
    text = open(os.path.join(REPO_ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
    slug = lambda heading: re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))   # noqa: E731
    contents = text[:text.index("\n## ")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    anchors = {slug(h) for h in re.findall(r"^#{2,3} (.+)$", text, re.M)}
    sections = [slug(h) for h in re.findall(r"^## (.+)$", text, re.M)]
    assert not sorted(set(links) - anchors), "contents links that land nowhere"
    assert [s for s in sections if s not in links] == [], "sections the contents leave out"
