"""report.html (runtime/gallery.py): written beside report.json by generate and `ditango
report`, self-contained, every video found relative to the page, untrusted text inert; and in
a real browser (Debian's Chromium, driven by playwright), every video loads and no prompt runs."""

from __future__ import annotations

import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ditango_cli.app import app
from runtime.gallery import render

HOSTILE = 'a red kite <script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2">'
ARGS = ["--steps", "3", "--height", "32", "--width", "64", "--frames", "9", "--device", "cpu", "--quiet",
        "--step-cache", "first-block", "--reference", "exact"]  # fmt: skip


class Sources(HTMLParser):
    """Every src / poster / href of the page, and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str, str]] = []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        self.scripts += tag == "script"
        for key, value in attrs:
            if key in ("src", "poster", "href"):
                self.links.append((tag, key, value))


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """A 3-item batch with --reference exact (a step cache approximates), one item failed on
    purpose (a guidance that overflows: non-finite latents, never retried)."""
    from typer.testing import CliRunner

    root = tmp_path_factory.mktemp("gallery")
    lines = [
        {"id": "kite", "prompt": HOSTILE},
        {"id": "boom", "prompt": "an item that fails", "guidance": 1e300},
        {"id": "boat", "prompt": "a blue boat", "seed": 3},
    ]
    (root / "batch.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = root / "out"
    result = CliRunner().invoke(app, ["generate", "--prompts", str(root / "batch.jsonl"), "--out", str(out), *ARGS])
    assert result.exit_code == 1 and "boom" in result.stderr, result.stderr[-2000:]
    return out


def test_the_page_is_self_contained_and_shows_every_item(batch):
    page = (batch / "report.html").read_text()
    assert not re.search(r"https?:", page), "nothing from the network"
    parser = Sources()
    parser.feed(page)
    assert parser.scripts == 1  # the page's own: no prompt became a script
    videos = [v for tag, key, v in parser.links if tag == "video" and key == "src"]
    assert sorted(videos) == ["boat.exact.mp4", "boat.mp4", "kite.exact.mp4", "kite.mp4"]
    assert sorted(v for tag, key, v in parser.links if key == "poster") == ["boat.poster.png", "kite.poster.png"]
    for _, _, link in parser.links:
        assert not link.startswith("/") and (batch / link).is_file(), link
    assert "<script>window.pwned" not in page and "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page
    assert 'onerror="window' not in page
    report = json.loads((batch / "report.json").read_text())
    (failed,) = [i for i in report["items"] if i["status"] == "failed"]
    assert failed["id"] == "boom" and "NonFiniteLatents" in page and "an item that fails" in page
    assert "2 done, 1 failed, 0 skipped" in page and "videos per hour" in page
    assert "CPU-hours" in page and "GPU-hours" not in page  # its ranks ran on CPUs
    assert "ditango generate --config report.json" in page and "<td>settings</td>" in page
    plots = [v for tag, key, v in parser.links if tag == "img" and key == "src"]
    assert plots and set(plots) <= {v for tag, key, v in parser.links if tag == "a" and key == "href"}
    for item in (i for i in report["items"] if i["status"] == "done"):
        assert item["quality"]["video"] == f"{item['id']}.exact.mp4" and (batch / item["steps_png"]).is_file()
        errors = item["quality"]["rel_err_per_step"]  # the latents' distance from the exact run, step by step
        assert len(errors) == item["steps"] and all(e >= 0 for e in errors)
        assert errors[-1] == pytest.approx(item["quality"]["latent_rel_err"], rel=1e-4, abs=1e-7)


def test_ditango_report_writes_the_page_for_a_folder_of_an_earlier_run(runner, batch, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(batch, old)
    (old / "report.html").unlink()
    result = runner.invoke(app, ["report", str(old)])
    assert result.exit_code == 0, result.stderr
    assert (old / "report.html").is_file() and "boom" in (old / "report.html").read_text()


def test_damaged_records_render_without_error(tmp_path):
    report = {
        "model": "<b>m</b>",
        "layout": [1],
        "counts": "x",
        "options": None,
        "layout_choice": 5,
        "items": [
            {
                "id": "x",
                "status": "done",
                "video": "../../etc/passwd",
                "attention": "a",
                "hybrid": 3,
                "quality": {"psnr": "nan", "video": "/abs.mp4"},
                "timing": [1],
                "loras": "s",
            },
            "not an item",
            {"status": "weird", "quality": [2]},
        ],
    }
    page = render(report, tmp_path)
    assert "<b>m</b>" not in page and "&lt;b&gt;m&lt;/b&gt;" in page
    assert "src=" not in page, "a name outside the folder, or of no file, is never linked"
    (tmp_path / "x.mp4").write_bytes(b"")
    report["items"][0]["video"] = "x.mp4"
    assert 'src="x.mp4"' in render(report, tmp_path)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser():
    """Debian's Chromium under playwright; skipped without one, except in CI (.ci/run installs it)."""
    path = chromium()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: .ci/run installs Debian's chromium package")
        pytest.skip("no Chromium here (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=path, args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
        )
        try:
            yield browser
        finally:
            browser.close()


def test_in_a_browser_every_video_loads_and_no_prompt_runs(batch, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    failed, dialogs, errors = [], [], []
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((batch / "report.html").as_uri())
    page.wait_for_function(
        "Array.from(document.querySelectorAll('video')).every(v => v.readyState >= 2)", timeout=30_000
    )
    states = page.evaluate(
        "Array.from(document.querySelectorAll('video')).map(v => [v.currentSrc, v.readyState, "
        "v.videoWidth, v.error && v.error.code])"
    )
    assert len(states) == 4 and all(s[1] >= 2 and s[2] == 64 and s[3] is None for s in states), states
    images = page.evaluate("Array.from(document.images).map(i => [i.src, i.complete && i.naturalWidth > 0])")
    assert images and all(ok for _, ok in images), images
    assert page.evaluate("typeof window.pwned") == "undefined" and not dialogs and not errors and not failed
    screenshot = tmp_path / "report.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000
    # The controls: only the failed item shown, then every item sorted by time.
    page.select_option("#status", "failed")
    visible = page.evaluate(
        "Array.from(document.querySelectorAll('article')).filter(a => !a.hidden).map(a => a.dataset.id)"
    )
    assert visible == ["boom"]
    page.select_option("#status", "all")
    page.select_option("#sort", "time")
    order = page.evaluate("Array.from(document.querySelectorAll('article')).map(a => a.dataset.id)")
    times = {
        i["id"]: (i.get("timing") or {}).get("total_s")
        for i in json.loads((batch / "report.json").read_text())["items"]
    }
    done = [i for i in order if times.get(i) is not None]
    assert done == sorted(done, key=lambda i: times[i]) and order[-1] == "boom"
    plot = Path(batch / "kite.steps.png")
    page.goto(plot.as_uri())
    page.screenshot(path=str(tmp_path / "plot.png"))
    print(f"screenshots: {screenshot} {tmp_path / 'plot.png'}")


def test_the_summary_counts_the_gpus_of_every_replica():
    from runtime.gallery import summary

    report = {
        "device": "cuda:0",
        "layout": {"world_size": 2, "strategy": "ring", "nodes": 1},
        "options": {"replicas": 1},
        "wall_s": 1800.0,
        "counts": {"done": 6, "failed": 1},
    }
    rows = dict(summary(report))
    assert rows["videos per hour"] == "12.0" and rows["GPU-hours"].startswith("1.000 (2 rank(s)")
    report["layout_choice"] = {"replicas": 4}  # --layout auto chose them: the options say 1
    assert dict(summary(report))["GPU-hours"].startswith("4.000 (8 rank(s)")
    assert rows["command"].startswith("ditango generate --config report.json")
    report["options"] = {"replicas": 1, "prompt": "a <b>red</b> ball", "cfg_parallel": False, "lease": 60.0}
    assert dict(summary(report))["settings"] == "replicas 1; prompt a <b>red</b> ball; cfg_parallel off; lease 60.0"
    report["device"] = "cpu"  # ranks on CPUs: the same figure, named for what it counts
    rows = dict(summary(report))
    assert "GPU-hours" not in rows and rows["CPU-hours"].startswith("4.000 (8 rank(s)")


def test_the_summary_says_the_kernel_the_compile_and_the_quantization():
    from runtime.gallery import summary

    report = {
        "attention_backend": "flash3",
        "compile": {"enabled": True, "blocks": 40, "compiles": 2, "fallback": None},
        "quantize": {"format": "fp8_e4m3", "layers": 400},
        "timing": {"compile_s": 12.34},
    }
    assert (
        dict(summary(report))["kernels"] == "attention flash3; compiled (12.3 s compiling); fp8_e4m3: 400 linear layers"
    )
    report["compile"]["fallback"] = "BackendCompilerFailed: CppCompileError: no gcc"
    report["quantize"] = None
    assert dict(summary(report))["kernels"] == (
        "attention flash3; compile failed, ran eager (BackendCompilerFailed: CppCompileError: no gcc)"
    )
    assert "kernels" not in dict(summary({"compile": {"enabled": False}}))
