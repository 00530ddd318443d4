"""The explorer's page: ``page.html`` with ``explorer.css`` and ``explorer.js`` inlined, and a result or none.

One document serves both uses. From the server it carries no result (``null``) and asks ``/api/attention`` for
one; exported, it carries the result and makes no request at all, so it opens from disk with no network.
Nothing is loaded from elsewhere: no CDN, no web font (labels use the system's fonts, CJK ones included).
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from typing import Any


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(result: dict[str, Any] | None, title: str) -> str:
    """The HTML of the page titled ``title``; ``result`` (from :mod:`qkv.explore.results`) inlined, or None for
    the server's page."""
    # inside <script type="application/json">, "<" is written as \u003c: no "</script>" can end it early
    data = json.dumps(result, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    parts = {"/*QKV_CSS*/": _asset("explorer.css"), "/*QKV_JS*/": _asset("explorer.js"), "__QKV_DATA__": data,
             "__QKV_TITLE__": html.escape(title)}
    template = _asset("page.html")
    missing = [p for p in parts if p not in template]
    if missing:
        raise RuntimeError(f"page.html lacks its placeholders {missing}")
    # one pass over the template: what is put in is never searched for placeholders itself
    return re.sub("|".join(map(re.escape, parts)), lambda m: parts[m.group(0)], template)
