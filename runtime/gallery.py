"""report.html: one static page beside report.json that shows a batch. A summary (model,
layout, items done, failed and skipped, videos per hour and GPU-hours (CPU-hours for ranks on CPUs) from the run's wall
time, load included, and quality against exact where measured), then every item: its video
(muted, looping while in view, with its poster frame), the exact run's beside it with PSNR and SSIM under
--reference exact, its prompt and settings, a failed item's error, and its plots. A few lines
of plain script filter by status and sort by id, time or quality.

The page is self-contained: no network (no CDN, no web font), every file named relative to
the page, so it works from a shared file system and when the folder is copied elsewhere.
Prompts, errors and every other value of the report are untrusted text: each is escaped, and
the script reads nothing but numbers from the page."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from urllib.parse import quote

from runtime.video import write_bytes

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
h1{font-size:1.4em}table.summary td{padding:.15em .8em .15em 0;vertical-align:top}
#controls{margin:1em 0}#controls label{margin-right:1.5em}
#grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:1em}
article{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.8em}
article.failed{border-color:#c00000;background:#fff5f5}
.videos{display:flex;gap:.5em}.videos figure{margin:0;flex:1}
video,img.plot{width:100%;height:auto;background:#000}img.plot{background:#fff;margin-top:.4em}
figcaption{font-size:.8em;color:#555}.prompt{font-style:italic;margin:.4em 0;white-space:pre-wrap}
dl{display:grid;grid-template-columns:max-content 1fr;gap:0 .8em;font-size:.85em;margin:.4em 0}
dt{color:#666}dd{margin:0}.error{color:#900;white-space:pre-wrap;font-family:monospace;font-size:.8em}
"""
# Reads only the data-* numbers the page was written with; moves existing nodes, writes no markup.
SCRIPT = """
(function () {
  const grid = document.getElementById('grid');
  const items = Array.from(grid.children);
  function num(el, key) { const v = parseFloat(el.dataset[key]); return isNaN(v) ? null : v; }
  function apply() {
    const status = document.getElementById('status').value;
    const key = document.getElementById('sort').value;
    const sorted = items.slice().sort(function (a, b) {
      if (key === 'id') { return a.dataset.id < b.dataset.id ? -1 : a.dataset.id > b.dataset.id ? 1 : 0; }
      const x = num(a, key), y = num(b, key);
      if (x === null) { return y === null ? 0 : 1; }
      if (y === null) { return -1; }
      return key === 'time' ? x - y : y - x;
    });
    for (const el of sorted) {
      el.hidden = status !== 'all' && el.dataset.status !== status;
      grid.appendChild(el);
    }
  }
  document.getElementById('status').addEventListener('change', apply);
  document.getElementById('sort').addEventListener('change', apply);
  apply();
  // Only the videos in view play: a batch of hundreds stays light.
  const seen = new IntersectionObserver(function (entries) {
    for (const e of entries) { if (e.isIntersecting) { e.target.play().catch(function () {}); } else { e.target.pause(); } }
  });
  document.querySelectorAll('video').forEach(function (v) { seen.observe(v); });
})();
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _file(out_dir: Path, name) -> str | None:
    """`name` as a link relative to the page when it is a file of the folder, else None."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        return None
    return quote(name) if (out_dir / name).is_file() else None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) else None


def _video(src: str, poster: str | None, caption: str) -> str:
    poster_attr = f' poster="{poster}"' if poster else ""
    return (
        f'<figure><video src="{src}"{poster_attr} muted loop playsinline controls preload="metadata">'
        f"</video><figcaption>{caption}</figcaption></figure>"
    )


def _item(out_dir: Path, item: dict) -> str:
    status = item.get("status") if item.get("status") in ("done", "failed", "skipped") else "unknown"
    timing, quality = _dict(item.get("timing")), _dict(item.get("quality"))
    total, psnr, ssim = _number(timing.get("total_s")), _number(quality.get("psnr")), _number(quality.get("ssim"))
    data = (
        f'data-id="{_e(item.get("id", ""))}" data-status="{status}" data-time="{"" if total is None else total}" '
        f'data-quality="{"" if psnr is None else psnr}"'
    )
    parts = [f'<article class="{status}" {data}>']
    videos = []
    video, poster = _file(out_dir, item.get("video")), _file(out_dir, item.get("poster"))
    if video:
        videos.append(_video(video, poster, "this run"))
    exact = _file(out_dir, quality.get("video"))
    if exact:
        measured = " ".join(
            f"{k} {v:.2f}" if k == "PSNR" else f"{k} {v:.4f}"
            for k, v in (("PSNR", psnr), ("SSIM", ssim))
            if v is not None
        )
        videos.append(_video(exact, None, f"exact reference; {_e(measured) or 'identical (PSNR inf)'}"))
    if videos:
        parts.append(f'<div class="videos">{"".join(videos)}</div>')
    parts.append(f"<h3>{_e(item.get('id', '?'))} <small>({_e(status)})</small></h3>")
    parts.append(f'<p class="prompt">{_e(item.get("prompt", ""))}</p>')
    fields = [
        ("seed", item.get("seed")),
        ("steps", item.get("steps")),
        ("size", f"{item.get('width')}x{item.get('height')}x{item.get('frames')}"),
        ("guidance", item.get("guidance")),
        ("scheduler", item.get("scheduler")),
        ("time", None if total is None else f"{total:.2f} s"),
        ("PSNR vs exact", None if psnr is None else f"{psnr:.2f} dB"),
        (
            "loras",
            ", ".join(f"{a.get('source')}:{a.get('scale')}" for a in item.get("loras") or [] if isinstance(a, dict))
            or None,
        ),
    ]
    parts.append("<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in fields if v is not None) + "</dl>")
    if status == "failed":
        attempts = item.get("attempts")
        parts.append(
            f'<p class="error">{_e(item.get("error") or "failed")}'
            + (f" (attempts: {_e(attempts)})" if attempts else "")
            + "</p>"
        )
    plots = [
        (_dict(item.get("attention")).get("plan_png"), "DiTango's plan: attention computed per step and layer"),
        (item.get("steps_png"), "per step: time, and the attention computed"),
        (_dict(item.get("hybrid")).get("rel_mae_png"), "Hybridiff's monitor per step"),
    ]
    for name, alt in plots:
        src = _file(out_dir, name)
        if src:
            # Small in the card; the link opens it at full size.
            parts.append(
                f'<a href="{src}" title="open at full size"><img class="plot" loading="lazy" src="{src}" '
                f'alt="{_e(alt)}"></a>'
            )
    parts.append("</article>")
    return "".join(parts)


def summary(report: dict) -> list[tuple[str, str]]:
    items = [i for i in report.get("items") or [] if isinstance(i, dict)]
    layout, options, counts = _dict(report.get("layout")), _dict(report.get("options")), _dict(report.get("counts"))
    wall = _number(report.get("wall_s"))
    choice = _dict(report.get("layout_choice"))
    replicas = _number(choice.get("replicas")) or _number(options.get("replicas")) or 1  # --layout auto's, or given
    gpus = (_number(layout.get("world_size")) or 1) * replicas
    done = counts.get("done", 0) if isinstance(counts.get("done", 0), int) else 0
    rows = [
        ("model", str(report.get("model"))),
        (
            "layout",
            f"{layout.get('strategy')} on {gpus:g} rank(s), {replicas:g} replica(s), "
            f"{layout.get('nodes')} node(s) a replica",
        ),
        ("items", ", ".join(f"{counts.get(k, 0)} {k}" for k in ("done", "failed", "skipped"))),
    ]
    if wall:
        rows.append(("wall time", f"{wall:.1f} s, loading included"))
        rows.append(("videos per hour", f"{done / wall * 3600:.1f}"))
        unit = "GPU" if str(report.get("device", "cuda")).startswith("cuda") else "CPU"  # ranks on CPUs: CPU-hours
        rows.append((f"{unit}-hours", f"{gpus * wall / 3600:.3f} ({gpus:g} rank(s) x the wall time)"))
    measured = [(_number(q.get("psnr")), _number(q.get("ssim"))) for q in (_dict(i.get("quality")) for i in items) if q]
    if measured:
        psnrs = [p for p, _ in measured if p is not None]
        ssims = [s for _, s in measured if s is not None]
        text = f"{len(measured)} item(s) against exact"
        text += f"; PSNR mean {sum(psnrs) / len(psnrs):.2f} dB, min {min(psnrs):.2f}" if psnrs else "; identical"
        text += f"; SSIM mean {sum(ssims) / len(ssims):.4f}" if ssims else ""
        rows.append(("quality", text))
    if speed := _speed(report):
        rows.append(("kernels", speed))
    if options:  # what made the batch: report.json runs it again
        rows.append(("command", "ditango generate --config report.json (these settings again)"))
        rows.append(("settings", "; ".join(f"{k} {_setting(v)}" for k, v in options.items())))
    return rows


def _setting(value) -> str:
    """An option's value as the command line spells it (a flag's on or off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value if isinstance(value, str) else json.dumps(value)


def _speed(report: dict) -> str:
    """The attention kernel, --compile (its time, or why it fell back) and --quantize."""
    compiled, quantized = _dict(report.get("compile")), _dict(report.get("quantize"))
    parts = [f"attention {report['attention_backend']}"] if report.get("attention_backend") else []
    if compiled.get("fallback"):
        parts.append(f"compile failed, ran eager ({compiled['fallback']})")
    elif compiled.get("enabled"):
        seconds = _number(_dict(report.get("timing")).get("compile_s"))
        parts.append("compiled" + ("" if seconds is None else f" ({seconds:.1f} s compiling)"))
    if quantized:
        parts.append(f"{quantized.get('format')}: {quantized.get('layers')} linear layers")
    return "; ".join(parts)


def render(report: dict, out_dir: Path) -> str:
    items = [i for i in report.get("items") or [] if isinstance(i, dict)]
    head = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>ditango: {_e(report.get('model'))}, {len(items)} item(s)</title><style>{STYLE}</style></head>"
    )
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in summary(report))
    controls = (
        '<div id="controls"><label>status <select id="status"><option value="all">all</option>'
        '<option value="done">done</option><option value="failed">failed</option>'
        '<option value="skipped">skipped</option></select></label><label>sort by <select id="sort">'
        '<option value="id">id</option><option value="time">time (fastest first)</option>'
        '<option value="quality">PSNR (best first)</option></select></label></div>'
    )
    grid = "".join(_item(out_dir, i) for i in items)
    return (
        f'{head}<body><h1>{_e(report.get("model"))}: {len(items)} item(s)</h1><table class="summary">{rows}'
        f'</table>{controls}<div id="grid">{grid}</div><script>{SCRIPT}</script></body></html>\n'
    )


def write_gallery(out_dir: Path, report: dict) -> Path:
    """OUT/report.html for `report` (report.json's content)."""
    path = out_dir / "report.html"
    write_bytes(path, render(report, out_dir).encode("utf-8"))
    return path
