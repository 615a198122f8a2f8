"""The notebook's text on each addition comes from its registry entry: a made-up addition's text shows up where
each reader of Utils.report.notebook_prose puts it, and the markdown it sets keeps its paragraphs whole."""
import pytest

from Utils.ladder import registry
from Utils.ladder.registry import ADDITIONS, Addition
from Utils.report import notebook_prose as prose

WARP = Addition("warp", "compile", "overhead", "a step in no time", scores_on_chip=True, in_max=True,
                title="the warp drive", notebook=("**What changes.** Everything.", "**What it costs.** Nothing."),
                phrase="a drive that bends space (`warp`)", why="the step folds space")


@pytest.fixture
def warp(monkeypatch):
    monkeypatch.setitem(ADDITIONS, "warp", WARP)


def test_an_additions_section_is_its_title_and_paragraphs(warp):
    assert prose.section("warp") == "### warp: the warp drive\n\n**What changes.** Everything.\n\n**What it costs.** Nothing."


def test_the_max_list_joins_each_additions_phrase(warp):
    assert prose.listing(["warp"]) == "a drive that bends space (`warp`)"
    assert prose.listing(["vocab_multiple", "warp"]) == f"{ADDITIONS['vocab_multiple'].phrase} and {WARP.phrase}"
    assert prose.listing(["prefetch", "vocab_multiple", "warp"]) == \
        f"{ADDITIONS['prefetch'].phrase}, {ADDITIONS['vocab_multiple'].phrase}, and {WARP.phrase}"


def test_the_reasons_give_a_shared_reason_once_and_skip_an_addition_without_one(warp):
    assert prose.reasons(["warp", "cudnn_attention", "prefetch", "sync_every", "cudagraphs"]) == \
        f"the step folds space; {registry._HOST_WAIT}"


def test_the_floors_name_the_additions_their_roofline_facts_pick(warp):
    attention = prose.floor_inputs().split("the attention (")[1].split(")")[0]
    assert attention.endswith(", `packed_attention` or `warp`")
    assert "`warp`" not in prose.floor_inputs().replace(attention, "")


def test_named_joins_code_names():
    assert prose.named([]) == "" and prose.named(["a"]) == "`a`"
    assert prose.named(["a", "b", "c"]) == "`a`, `b` or `c`" and prose.named(["a", "b"], last=", ") == "`a`, `b`"


def test_a_paragraph_is_wrapped_without_starting_a_line_as_markdown_would_start_a_block():
    text = " ".join(["(x̂γ + β)Wᵀ + b = x̂(W diag γ)ᵀ + (b + Wβ), a well-known sum - 1. # > *"] * 12)
    lines = prose.paragraph(text).splitlines()
    assert len(lines) > 3 and " ".join(lines) == " ".join(text.split())
    assert not any(prose._BLOCK_START.match(line) for line in lines)
    plain = prose.paragraph("x " * 50 + "well-known " * 20).splitlines()
    assert all(len(line) <= prose.WIDTH for line in plain) and not any(line.endswith("-") for line in plain)
    assert prose.paragraphs("# h", "a  b") == "# h\n\na b"
