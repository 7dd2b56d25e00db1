"""The gates decide exactly as they did when tests/data/gate_decisions.json.gz was recorded (before the gates were
made faster): every verdict, reason, signal and edit of every gate, alone and chained, on every page of the bundled
sample, of tests/data/docs_pages.warc.gz and of seeded synthetic pages (tests/gate_decisions.py says how; rerun
`python tests/gate_decisions.py record examples/data/sample.warc.gz,tests/data/docs_pages.warc.gz
tests/data/gate_decisions.json.gz` only for a change that means to decide differently)."""

from __future__ import annotations

import gate_decisions


def test_every_gate_decides_as_recorded():
    recorded = gate_decisions.read(gate_decisions.GOLDEN)
    now = gate_decisions.all_decisions([gate_decisions.SAMPLE_WARC, gate_decisions.DOCS_WARC])
    assert sum(map(len, now.values())) == 201
    diff = gate_decisions.first_difference(recorded, now)
    assert diff is None, diff
