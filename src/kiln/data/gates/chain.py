"""The gate chain: `default_gates(cfg)` lists the steps `data.quality.*` turns on, in running order;
`apply_gates` runs them over documents, each reading one shared TextView until an edit changes the text."""

from __future__ import annotations

from typing import Iterator

from kiln.data.document import Document
from kiln.data.gates.basic import low_letters, repetitive_lines, too_short
from kiln.data.gates.blocklist import url_blocklist
from kiln.data.gates.c4 import c4_lines
from kiln.data.gates.fineweb import fineweb_rules
from kiln.data.gates.gopher import gopher_quality, gopher_repetition
from kiln.data.gates.noise import token_noise
from kiln.data.gates.pii import redact_pii
from kiln.data.gates.residue import format_residue
from kiln.data.gates.text import TextView
from kiln.data.gates.types import Edit, Gate, Score


def default_gates(cfg) -> list[Gate]:
    """The steps `cfg` (a DataConfig) turns on, in running order."""
    q = cfg.quality
    on = lambda section, make: [make(section)] if section.enabled else []  # noqa: E731
    return [
        *([url_blocklist(cfg.blocklist.file)] if cfg.blocklist.file else []),
        *on(q.residue, format_residue),  # measures markup before the edits below remove any of it
        *on(q.gopher_repetition, gopher_repetition),  # FineWeb's order: Gopher, C4, FineWeb
        *on(q.gopher_quality, gopher_quality),
        *on(q.c4, c4_lines),
        *on(q.fineweb, fineweb_rules),
        *on(q.noise, token_noise),
        # after the edits, so that every kept document meets them as written out
        too_short(cfg.min_chars), low_letters(cfg.min_letter_frac), repetitive_lines(cfg.max_dup_line_frac),
        *on(q.pii, redact_pii),
        *(_classifier(q.classifier) if q.classifier.model else []),  # last: it scores the text as written out
        *(_semantic(q.semantic) if q.semantic.keywords else []),
    ]


def _semantic(cfg) -> list[Gate]:
    from kiln.data.gates.semantic import semantic_gate  # floret is imported only when keywords are set

    return [semantic_gate(cfg)]


def _classifier(cfg) -> list[Gate]:
    from kiln.data.gates.classifier import classifier_gate  # floret is imported only when a model is set

    return [classifier_gate(cfg)]


def apply_gates(docs: Iterator[Document], gates: list[Gate], drop: bool = True) -> Iterator[Document]:
    """Each gate reads one shared TextView of the document (split once); an edit makes a new view.

    drop=False runs every gate on every document and rejects none: the cost of the whole chain whatever the
    verdicts (`python -m benchmarks data_vs_datatrove` compares pipelines so, since each stops at its first
    drop and two pipelines drop different documents)."""
    for doc in docs:
        if doc.rejection is None:
            edits = doc.edits
            view = TextView(doc.text or "", doc.lang)
            for gate in gates:
                result = gate(doc.url if getattr(gate, "reads_url", False) else view)
                if isinstance(result, Edit):
                    doc.text = result.text
                    view = result.view or TextView(doc.text, doc.lang)
                    for k, v in result.counts.items():
                        edits[k] = edits.get(k, 0) + v
                elif isinstance(result, Score):
                    doc.scores[result.field] = result.value
                elif result is not None and drop:
                    reason, signals = result
                    doc.reject("quality", reason, **doc.scores, **signals, **({"edits": dict(edits)} if edits else {}))
                    break
        yield doc
