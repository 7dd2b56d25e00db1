"""The data stage's one step protocol (kiln.data.steps): what the workers and the merge chain, in which order,
each timed under its name, rejected documents passed through so the accounting holds."""

from __future__ import annotations

from conftest import english_pages
from kiln.config import DataConfig
from kiln.data.document import Document
from kiln.data.gates.classifier import histogram
from kiln.data.steps import Dedup, StepTimer, TopFraction, merge_steps, run_steps, task_steps



def doc(i: int, payload: bytes) -> Document:
    return Document(id=f"d{i}", url=f"https://d.example/{i}", source="s.warc", offset=i, length=1, payload=payload)


def test_task_steps_run_in_order_and_each_is_timed_under_its_name():
    cfg = DataConfig()
    steps = task_steps(cfg)
    assert [s.name for s in steps] == ["extract", "language", "gates"]
    assert [s.name for s in task_steps(DataConfig(quality={"perplexity": {"max_bits_per_byte": 2.0}}))] == [
        "extract", "language", "gates", "perplexity"]
    timer = StepTimer()
    page = english_pages()[0][1]  # a real Debian Reference chapter
    docs = [doc(0, page), doc(1, b"\x00\x01binary" * 100), doc(2, b"<html><body>hi</body></html>")]
    out = list(run_steps(timer.wrap("read", iter(docs)), steps, timer))
    assert [d.id for d in out] == ["d0", "d1", "d2"]  # every document reaches the end, in order
    assert out[0].rejection is None and out[0].lang == "en" and "Debian" in out[0].text and out[2].text == "hi"
    assert (out[1].rejection.stage, out[1].rejection.reason) == ("extract", "binary_payload")
    assert out[2].rejection.stage == "language"  # two letters: too little for language ID
    assert list(timer.own()) == ["read", "extract", "language", "gates"]


class Verdicts:
    """What Dedup asks of kiln.data.dedup.stages.Verdicts: the rejections in document order."""

    def __init__(self, rows):
        self.rows = rows

    def rejections(self):
        return iter(self.rows)


def test_merge_steps_cut_the_top_fraction_after_dedup_numbers_the_kept_documents():
    docs = [Document(id=f"d{i}", url=None, source="s", offset=i, length=1, text="x") for i in range(4)]
    docs[0].reject("quality", "too_short")  # rejected on a worker: not numbered
    for d, score in zip(docs[1:], (0.01, 0.9, 0.95)):
        d.scores["quality_score"] = score
    verdicts = Verdicts([(2, "exact_duplicate", {"duplicate_of": "d2"})])  # kept document number 2 is d3
    summaries = [{"keep_top_fraction": 0.5, "score_histogram": histogram([0.01, 0.9, 0.95])}]  # as a task sums
    steps = merge_steps(verdicts, 0, summaries)
    assert [type(s) for s in steps] == [Dedup, TopFraction] and [s.name for s in steps] == ["dedup", "top_fraction"]
    out = list(run_steps(iter(docs), steps, StepTimer()))
    why = [d.rejection and d.rejection.reason for d in out]
    assert why == ["too_short", "classifier_below_top_fraction", None, "exact_duplicate"]
    assert [s.name for s in merge_steps(verdicts, 0, [{}])] == ["dedup"]


class Recorder:
    """A step that notes, for each document it passes on, how many documents the source had given by then."""

    name = "recorder"

    def __init__(self, pulls: list[int]):
        self.pulls, self.seen = pulls, []

    def __call__(self, docs):
        for d in docs:
            self.seen.append(len(self.pulls))
            yield d


def test_steps_take_their_documents_in_bounded_batches_and_an_upstream_error_comes_after_its_documents(
        monkeypatch):
    import kiln.data.steps as steps_module

    monkeypatch.setattr(steps_module, "BATCH_DOCS", 4)
    monkeypatch.setattr(steps_module, "BATCH_BYTES", 1000)
    pulls: list[int] = []

    def source():
        for i in range(10):
            pulls.append(i)
            yield Document(id=f"d{i}", url=None, source="s", offset=i, length=1, text="x" * (1000 if i == 5 else 10))
        raise RuntimeError("cut input")  # after the 10 documents: every one of them must still come out

    first, second = Recorder(pulls), Recorder(pulls)
    out = run_steps(source(), [first, second], StepTimer())
    got = []
    try:
        for d in out:
            got.append(d.id)
    except RuntimeError as exc:
        assert str(exc) == "cut input"
    else:
        raise AssertionError("the upstream error was lost")
    assert got == [f"d{i}" for i in range(10)]
    # a batch closes at 4 documents or at 1,000 bytes of text (d4 + d5): each step ran over a whole batch
    # before the next step saw any of it
    assert first.seen == [4, 4, 4, 4, 6, 6, 10, 10, 10, 10] == second.seen
