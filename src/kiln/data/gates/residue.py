"""Format residue: markup that survived extraction (SEEDS' syntax/format gate).

Counted per document: HTML tags and entities left in the text, JSON fragments that do not
parse, and Markdown/ASCII table rows whose cell count disagrees with the row before. The
document is dropped when these events exceed `max_per_kchar` per 1,000 characters.
"""

from __future__ import annotations

import json
import re
from itertools import compress, repeat

from kiln.data.gates.noise import _ENTITY, _TAG
from kiln.data.gates.text import TextView, as_view
from kiln.data.gates.types import Gate, Verdict, drop

_TAGS = re.compile(_TAG)
_ENTITIES = re.compile(_ENTITY)


def _broken_json(stripped: list[str]) -> int:
    """Lines that look like a JSON object or array ('{' or '[' then a '"key":') but do not parse."""
    broken = 0
    for line in compress(stripped, map(str.startswith, stripped, repeat(("{", "[")))):  # the few such lines
        line = line.rstrip(",")
        if '":' in line:
            try:
                json.loads(line)
            except ValueError:
                broken += 1
    return broken


def _ragged_table_rows(stripped: list[str]) -> int:
    """Table rows ('|' first, two or more) whose cell count differs from the row right before."""
    rows = [i for i in compress(range(len(stripped)), map(str.startswith, stripped, repeat("|")))
            if stripped[i].count("|") >= 2]  # the lines starting with "|" found in C, then only those counted
    ragged, prev, prev_row = 0, None, -2
    for i in rows:
        cells = stripped[i].strip("|").count("|") + 1
        ragged += prev is not None and prev_row == i - 1 and cells != prev
        prev, prev_row = cells, i
    return ragged


def format_residue(cfg) -> Gate:
    def gate(view: "str | TextView") -> Verdict:
        view = as_view(view)
        text = view.text
        if "<" not in text and "&" not in text and '":' not in text and "|" not in text:
            return None
        s = {"tags": len(_TAGS.findall(text)) if "<" in text else 0,
             "entities": len(_ENTITIES.findall(text)) if "&" in text else 0,
             "broken_json": _broken_json(view.stripped_lines) if '":' in text else 0,
             "ragged_table_rows": _ragged_table_rows(view.stripped_lines) if "|" in text else 0}
        s["per_kchar"] = round(sum(s.values()) * 1000 / max(len(text), 1), 3)
        return drop("format_residue", s, max=cfg.max_per_kchar) if s["per_kchar"] > cfg.max_per_kchar else None
    return gate
