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


class Counting:
    """A by-text step that counts the documents it decides and rejects the texts holding "spam", rewriting the
    others (an edit, as the gates make)."""

    name = "gates"
    by_text = True

    def __init__(self):
        self.decided = []

    def __call__(self, docs):
        for d in docs:
            if d.rejection is None:
                self.decided.append(d.id)
                if "spam" in d.text:
                    d.reject("quality", "spam", hits=d.text.count("spam"))
                else:
                    d.text = d.text.upper()
                    d.edits["upper"] = d.edits.get("upper", 0) + 1
                    d.scores["quality_score"] = len(d.text) / 100
            yield d


def _docs(texts):
    out = []
    for i, t in enumerate(texts):
        d = Document(id=f"d{i}", url=f"https://d.example/{i}", source="s", offset=i, length=1, text=t)
        if t is None:
            d.reject("extract", "empty")
        out.append(d)
    return out


def test_a_text_seen_before_gets_its_verdict_again_without_the_steps_in_order_and_field_for_field():
    from kiln.data.steps import TextMemo

    texts = ["alpha page", "spam spam", None, "alpha page", "beta page", "spam spam", "alpha page", None, "gamma"]
    plain, remembered = Counting(), Counting()
    want = list(run_steps(iter(_docs(texts)), [plain], StepTimer()))
    memo = TextMemo(16)
    got = list(run_steps(iter(_docs(texts)), [remembered], StepTimer(), memo))
    assert [vars(d) for d in got] == [vars(d) for d in want]  # every field of every document, in order
    assert remembered.decided == ["d0", "d1", "d4", "d8"] and memo.hits == 3
    assert got[3].edits is not got[0].edits and got[5].rejection.signals is not got[1].rejection.signals
    again = Counting()  # the next task on this worker: every text known
    assert [d.text for d in run_steps(iter(_docs(texts)), [again], StepTimer(), memo)] == [d.text for d in want]
    assert again.decided == [] and memo.hits == 3 + 7


def test_the_memo_holds_at_most_its_capacity_and_keeps_the_verdicts_asked_for(monkeypatch):
    import kiln.data.steps as steps_module
    from kiln.data.steps import TextMemo

    monkeypatch.setattr(steps_module, "BATCH_DOCS", 1)  # each text decided before the next is read
    memo = TextMemo(3)
    step = Counting()
    list(run_steps(iter(_docs(["a", "b", "c", "a", "d", "e", "a", "b"])), [step], StepTimer(), memo))
    assert len(memo.held) == 3
    assert step.decided == ["d0", "d1", "d2", "d4", "d5", "d7"]  # "a", asked for at d3, outlived b and c
    assert memo.hits == 2 and TextMemo.key("a") in memo.held and TextMemo.key("c") not in memo.held


def test_an_upstream_error_with_the_memo_comes_after_every_document_read_before_it(monkeypatch):
    import kiln.data.steps as steps_module
    from kiln.data.steps import TextMemo

    monkeypatch.setattr(steps_module, "BATCH_DOCS", 4)

    def source():
        yield from _docs(["x", "y", "x", None, "x", "z", "y"])
        raise RuntimeError("cut input")

    got = []
    try:
        for d in run_steps(source(), [Counting()], StepTimer(), TextMemo(8)):
            got.append((d.id, d.text))
    except RuntimeError as exc:
        assert str(exc) == "cut input"
    else:
        raise AssertionError("the upstream error was lost")
    assert got == [("d0", "X"), ("d1", "Y"), ("d2", "X"), ("d3", None), ("d4", "X"), ("d5", "Z"), ("d6", "Y")]


def test_the_data_stage_writes_the_same_docs_with_and_without_the_memo(tmp_path, sample_warc):
    import hashlib
    import json
    import shutil

    from kiln.data.pipeline import run_data

    inputs = []
    for i in range(2):  # the sample twice: half the pages are texts seen before
        inputs.append(str(tmp_path / f"copy-{i}.warc.gz"))
        shutil.copy(sample_warc, inputs[-1])

    def outputs(out):
        found = {}
        for p in sorted(out.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                if p.name in ("stats.json", "manifest.json"):
                    rec = json.loads(data)
                    for key in ("timings_s", "fingerprint", "files"):
                        rec.pop(key, None)
                    data = json.dumps(rec, sort_keys=True).encode()
                found[p.relative_to(out).as_posix()] = hashlib.sha256(data).hexdigest()
        return found

    off = run_data(inputs, tmp_path / "off", DataConfig(remember_texts=0))
    on = run_data(inputs, tmp_path / "on", DataConfig())
    assert on["documents"] == off["documents"] and on["documents"]["kept"] > 0
    assert outputs(tmp_path / "on") == outputs(tmp_path / "off")
    work = sorted(tmp_path.glob(".on-work-*"))
    assert not work  # removed after the commit


def test_the_memo_holds_edited_texts_compressed_within_its_bytes(monkeypatch):
    import kiln.data.steps as steps_module
    from kiln.data.steps import TextMemo

    monkeypatch.setattr(steps_module, "BATCH_DOCS", 1)
    monkeypatch.setattr(steps_module, "MEMO_BYTES", 400)
    texts = [f"page {i} " + "words that repeat " * 40 for i in range(12)]  # each upper-cased: an edit to hold
    memo = TextMemo(100)
    first = [d.text for d in run_steps(iter(_docs(texts)), [Counting()], StepTimer(), memo)]
    assert first == [t.upper() for t in texts]
    assert 0 < memo.bytes <= 400 and 1 < len(memo.held) < 12  # ~60 compressed bytes each: a few fit, not all
    again = Counting()
    assert [d.text for d in run_steps(iter(_docs(texts[-2:])), [again], StepTimer(), memo)] == first[-2:]
    assert again.decided == []  # the newest ones were held, and come back whole
