"""Quality gates: small steps that each compute signals, then keep, drop (reason, signals) or edit.

`default_gates(cfg)` lists the steps in the order they run; `apply_gates` runs them over documents (chain.py).
One module per gate family: basic (length, letters, duplicate lines), gopher, c4, fineweb, noise, residue,
blocklist, pii; `distribution` is the corpus-wide source profile, which runs after dedup, one task per data task.

Gates read a `TextView` (kiln.data.gates.text): the text split once into lines, tokens, words and
paragraphs, shared by every gate until an edit changes the text; a gate also accepts a plain string.

Edits (line removal, truncation, redaction) change the text; what they counted is kept in
`doc.edits` and, when a later gate drops the document, in its signals under "edits".
"""

from kiln.data.gates.basic import low_letters, repetitive_lines, too_short
from kiln.data.gates.chain import apply_gates, default_gates
from kiln.data.gates.distribution import SourceProfiles, source_weights
from kiln.data.gates.types import Edit, Gate, Score, Verdict

__all__ = ["Edit", "Gate", "Score", "Verdict", "SourceProfiles", "apply_gates", "default_gates", "low_letters",
           "repetitive_lines", "source_weights", "too_short"]
