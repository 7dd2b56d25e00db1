"""Why documents were dropped, told to a user: the rejection table and the config keys behind each reason.

Used when too few documents survive the data stage (the tokenizer and pack would fail later with less
to go on): `few_documents_message(stats, docs_dir)` is the error, with the table inside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.errors import IntegrityError
from kiln.manifest import verify_folder

G, R = "data.quality.gopher_quality", "data.quality.gopher_repetition"
# reason (without its stage) -> the config keys (or advice) that decide it.
REASON_KEYS: dict[str, str] = {
    "missing_text": "data.text_field (the field holding the text; default 'text')",
    "invalid_json": "the input is not JSON Lines (one JSON object per line)",
    "unreadable": "the input file itself (see file_errors in stats.json)",
    "too_large": "data.max_page_bytes",
    "not_html": "(WARC records that are not HTML are skipped)",
    "binary_payload": "(binary WARC payloads are skipped)",
    "empty_text": "data.extractor",
    "low_lang_score": "data.lang_threshold",
    "lang_not_allowed": "data.languages",
    "too_short": "data.min_chars",
    "low_letters": "data.min_letter_frac",
    "repetitive_lines": "data.max_dup_line_frac",
    "gopher_short_doc": f"{G}.min_words (or {G}.enabled=false)",
    "gopher_long_doc": f"{G}.max_words",
    "gopher_mean_word_len": f"{G}.min_mean_word_len, {G}.max_mean_word_len",
    "gopher_symbol_ratio": f"{G}.max_symbol_word_ratio",
    "gopher_bullet_lines": f"{G}.max_bullet_lines_frac",
    "gopher_ellipsis_lines": f"{G}.max_ellipsis_lines_frac",
    "gopher_alpha_words": f"{G}.min_alpha_words_frac",
    "gopher_stop_words": f"{G}.min_stop_words",
    "gopher_dup_paragraphs": f"{R}.max_dup_para_frac",
    "gopher_dup_paragraph_chars": f"{R}.max_dup_para_char_frac",
    "gopher_dup_line_chars": f"{R}.max_dup_line_char_frac",
    "gopher_top_ngram": f"{R}.top_ngram_max_char_frac (or {R}.enabled=false)",
    "gopher_dup_ngrams": f"{R}.dup_ngram_max_char_frac (or {R}.enabled=false)",
    "c4_lorem_ipsum": "data.quality.c4.drop_lorem_ipsum",
    "c4_curly_brace": "data.quality.c4.drop_curly_brace",
    "c4_lines_removed": "data.quality.c4.min_words_per_line, data.quality.c4.max_removed_lines_frac",
    "c4_few_sentences": "data.quality.c4.min_sentences",
    "fineweb_line_punct": "data.quality.fineweb.min_line_punct_ratio (or data.quality.fineweb.enabled=false)",
    "fineweb_short_lines": "data.quality.fineweb.max_short_line_ratio, data.quality.fineweb.short_line_chars",
    "fineweb_dup_line_chars": "data.quality.fineweb.max_dup_line_char_ratio",
    "fineweb_list_ratio": "data.quality.fineweb.max_list_ratio",
    "token_noise": "data.quality.noise.max_doc_noise",
    "token_noise_truncated_away": "data.quality.noise.min_keep_chars",
    "format_residue": "data.quality.residue.max_per_kchar",
    "url_blocklist": "data.blocklist.file",
    "exact_duplicate": "(duplicates of a kept document)",
}
# Below this many kept documents the tokenizer learns little and the validation split may be empty.
FEW_DOCUMENTS = 20


def governing_keys(reason: str) -> str:
    """'quality/gopher_short_doc' -> the config keys that decide it ('' when none is known)."""
    return REASON_KEYS.get(reason.rpartition("/")[2], "")


def rejection_table(stats: dict[str, Any], top: int = 8) -> str:
    """The top reasons as aligned lines: count, share of documents read, reason, the keys to change."""
    read = max(stats["documents"]["read"], 1)
    reasons = sorted(stats.get("rejected_by_reason", {}).items(), key=lambda kv: (-kv[1], kv[0]))
    if not reasons:
        return "  (no document was rejected)"
    width = max(len(r) for r, _ in reasons[:top])
    lines = [f"  {n:>8,}  {n / read:6.1%}  {r:<{width}}  <- {governing_keys(r) or '?'}" for r, n in reasons[:top]]
    if len(reasons) > top:
        lines.append(f"  ... and {len(reasons) - top} more reasons in stats.json")
    return "\n".join(lines)


def docs_stats(docs_dir) -> dict[str, Any]:
    """stats.json of a committed docs folder, checked against its manifest first (a changed one is named)."""
    try:
        verify_folder(Path(docs_dir), only={"stats.json"})
    except IntegrityError as exc:
        raise IntegrityError(f"{exc}; the docs folder changed after `kiln data` wrote it, run `kiln data` again") \
            from None
    return json.loads((Path(docs_dir) / "stats.json").read_text())


def few_documents_message(stats: dict[str, Any], docs_dir) -> str | None:
    """The error to raise when fewer than FEW_DOCUMENTS documents survived; None when enough did."""
    docs = stats["documents"]
    if docs["kept"] >= FEW_DOCUMENTS:
        return None
    head = (f"only {docs['kept']:,} of {docs['read']:,} documents survived the data stage "
            f"(at least {FEW_DOCUMENTS} are needed to train a tokenizer and hold out validation data)")
    if docs["read"] == 0:
        return (f"{head}: no document was read from the inputs; check data.inputs "
                f"(and data.text_field for JSONL/Parquet); details in {docs_dir}/stats.json")
    hint = ""
    if stats.get("rejected_by_reason", {}).get("read/missing_text") and (fields := _record_fields(docs_dir)):
        hint = f"\n  the records have the fields {', '.join(fields)}: set data.text_field to the one holding the text"
    return (f"{head}; rejections by reason, with the config keys that decide them "
            f"(details: {docs_dir}/stats.json, `kiln data explain FILE:LINE --out {docs_dir}`):\n"
            f"{rejection_table(stats)}{hint}")


def _record_fields(docs_dir) -> list[str] | None:
    """The fields of the first JSONL record rejected for missing text, read back from its input line
    (the reject's source and offset); reads up to that line of one file."""
    import json
    from pathlib import Path

    from kiln.data.docs import part_names, part_records
    from kiln.data.sources import _lines, is_url, open_input

    names = [p.relative_to(docs_dir).as_posix() for p in Path(docs_dir).glob("rejects/*") if p.is_file()]
    for name in part_names(names, "rejects"):
        with open(Path(docs_dir) / name, "rb") as part:
            rec = next((r for r in part_records(Path(docs_dir) / name, part) if r.get("reason") == "missing_text"
                        and not is_url(r.get("source") or "") and Path(r.get("source") or "").is_file()), None)
        if rec is None:
            continue
        source = rec["source"]
        offset = 0
        with open_input(source) as f:
            for line, length in _lines(f, source):
                if offset == rec.get("offset"):
                    try:
                        row = json.loads(line or b"")
                    except ValueError:
                        return None
                    return sorted(row)[:20] if isinstance(row, dict) else None
                offset += length
        return None
    return None
