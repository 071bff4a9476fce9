"""The explorer as one self-contained HTML file: the page's CSS and JS (package data
in viz/assets, plain JS, no library, no network) inlined around the recording.

The recording travels as JSON (labels, names, summaries, section offsets) and one
base64 blob, zlib-compressed (the page inflates it with the browser's
DecompressionStream): the float32 scales first, then the uint8 thumbnails, maps and
rollout.
"""

from __future__ import annotations

import base64
import html
import json
import re
import zlib
from importlib import resources
from pathlib import Path

from torch import Tensor

from .files import write_atomically
from .recording import Recording

ASSETS = ("explorer.html", "explorer.css", "explorer.js")


def asset(name: str) -> str:
    """The text of one of the page's files (mhsa/apps/viz/assets/NAME)."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _sections(parts: list[tuple[str, Tensor | None, str]]) -> tuple[dict, bytes]:
    """Concatenate the arrays (name, tensor, numpy dtype) into one buffer; each
    section's [byte offset, element count] by name (float32 ones first: aligned)."""
    offsets, chunks, size = {}, [], 0
    for name, tensor, dtype in parts:
        if tensor is None:
            continue
        data = tensor.detach().cpu().numpy().astype(dtype).tobytes()
        offsets[name] = [size, tensor.numel()]
        chunks.append(data)
        size += len(data)
    return offsets, b"".join(chunks)


def page_data(rec: Recording) -> dict:
    """The JSON the page reads: everything but the arrays, and the arrays' blob."""
    sections, blob = _sections(
        [
            ("map_scales", rec.map_scales, "<f4"),
            ("rollout_scales", rec.rollout_scales, "<f4"),
            ("map_rest", rec.map_rest, "<f4"),
            ("thumbs", rec.thumbs, "u1"),
            ("maps", rec.maps, "u1"),
            ("rollout", rec.rollout, "u1"),
        ]
    )
    return {
        "title": rec.title,
        "note": rec.note,
        "layers": rec.layer_names,
        "heads": rec.num_heads,
        "queries": rec.queries,
        "keys": rec.keys,
        "self": rec.self_attention,
        "rows": rec.rows,
        "rest": rec.rest_label,
        "stored": [list(pair) for pair in rec.stored],
        "thumb": list(rec.thumbs.shape[2:]),
        "stats": rec.stats,
        "sections": sections,
        "blob": base64.b64encode(zlib.compress(blob, 6)).decode("ascii"),
    }


def _json_for_script(data: dict) -> str:
    """JSON safe inside <script>: no '<' (so no '</script>' or '<!--' in a label)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render(rec: Recording) -> str:
    """The page's HTML text."""
    values = {
        "TITLE": html.escape(f"attention: {rec.title}"),
        "CSS": asset("explorer.css"),
        "JS": asset("explorer.js"),
        "DATA": _json_for_script(page_data(rec)),
    }
    # one pass: text put in (a label, the JS) is never scanned for placeholders again
    return re.sub(r"\{\{(TITLE|CSS|JS|DATA)\}\}", lambda m: values[m[1]], asset(ASSETS[0]))


def write_html(rec: Recording, path: str | Path, *, overwrite: bool = True) -> int:
    """Write the explorer page for rec to path (atomically: see write_atomically);
    returns its size in bytes."""
    data = render(rec).encode("utf-8")
    write_atomically(path, lambda tmp: tmp.write_bytes(data), overwrite=overwrite)
    return len(data)


__all__ = ["ASSETS", "asset", "page_data", "render", "write_html"]
