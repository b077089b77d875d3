"""Prompt files -> items: comments, precedence of per-item values, stable derived ids."""

from __future__ import annotations

import json

from runtime.items import Overrides, build_items, derived_id
from runtime.models.registry import REGISTRY

TINY = REGISTRY["tiny-wan"].defaults


def test_txt_skips_blank_and_comment_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# header\n\na red circle\n   # indented comment\n  a blue square  \n")
    items = build_items(None, f, Overrides(seed=9), TINY)
    assert [i.prompt for i in items] == ["a red circle", "a blue square"]
    assert [i.source for i in items] == ["p.txt line 3", "p.txt line 5"]
    assert all(i.seed == 9 for i in items)
    assert [i.id for i in items] == [derived_id(0, "a red circle", 9), derived_id(1, "a blue square", 9)]


def test_precedence_item_over_cli_over_model_default(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "a", "steps": 7, "negative_prompt": "bad"}) + "\n" + json.dumps({"prompt": "b"}) + "\n"
    )
    items = build_items(None, f, Overrides(steps=3, guidance=2.5), TINY)
    assert (items[0].steps, items[0].negative_prompt, items[0].guidance) == (7, "bad", 2.5)
    assert (items[1].steps, items[1].negative_prompt) == (3, TINY.negative_prompt)
    assert (items[1].height, items[1].width, items[1].frames) == (TINY.height, TINY.width, TINY.frames)


def test_derived_ids_are_short_safe_and_seed_dependent():
    prompt = "ünïcödé " * 100 + "/../etc"
    a, b = derived_id(3, prompt, 1), derived_id(3, prompt, 2)
    assert a != b and a.startswith("0003-") and len(a) == 13
    assert all(c.isalnum() or c == "-" for c in a)
    assert derived_id(3, prompt, 1) == a  # stable across calls (resume relies on it)
