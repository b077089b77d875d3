"""Prompt files -> items: comments, precedence of per-item values, stable derived ids."""

from __future__ import annotations

import json
import os
import threading

import pytest

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


def test_json_strings_holding_unicode_line_separators_stay_one_line(tmp_path):
    """Bug: prompt files were split with str.splitlines(), which also splits at U+2028, U+2029,
    U+0085 and the like: valid JSONL whose strings hold them was refused as broken lines."""
    prompts = ["a\u2028b", "c\u2029d", "e\x85f", "g\x1ch\x0bi\x0cj"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\r\n" for p in prompts), encoding="utf-8")
    items = build_items(None, f, Overrides(), TINY)
    assert [i.prompt for i in items] == prompts and [i.source for i in items] == [
        f"p.jsonl line {n}" for n in (1, 2, 3, 4)
    ]
    # Old Mac line ends still end lines.
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\ra blue\u2028square\r", encoding="utf-8")
    assert [i.prompt for i in build_items(None, txt, Overrides(), TINY)] == ["a red circle", "a blue\u2028square"]


@pytest.mark.parametrize("flag", ["--prompts", "--config", "--image"])
def test_a_fifo_given_as_a_file_is_one_line_not_a_hang(runner, tmp_path, flag):
    """Bug: `--image` naming a FIFO hung the pre-check (it waited for a writer); so did a FIFO as
    the prompt file or the run file."""
    from ditango_cli.app import app

    fifo = tmp_path / {"--prompts": "batch.jsonl", "--config": "run.toml", "--image": "cat.png"}[flag]
    os.mkfifo(fifo)
    args = ["check", "--out", str(tmp_path / "out"), flag, str(fifo)]
    if flag != "--prompts":
        args += ["--prompt", "a cat"]
    if flag == "--image":  # an image-to-video model: the image is checked before its weights are needed
        args += ["--model", "wan2.1-i2v-14b-480p"]
    # Should the FIFO be opened after all, a writer turns up after 30 s: the test fails, not hangs.
    rescue = threading.Timer(30, lambda: os.close(os.open(fifo, os.O_WRONLY)))
    rescue.daemon = True
    rescue.start()
    result = runner.invoke(app, args)
    rescue.cancel()
    assert result.exit_code == 2 and result.stderr.strip().endswith(
        f"{fifo} is a FIFO (named pipe), not a regular file"
    )
    assert len(result.stderr.strip().splitlines()) == 1
