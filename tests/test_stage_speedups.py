"""The data stage's faster paths (issue 44, "faster, not only smaller") compute what the plain ones did."""

from __future__ import annotations

import re

from kiln.data.gates.text import LETTER, TextView, words

TEXTS = [
    "",
    "plain English words, no Han at all\n  second line\tand a tab",
    "日本語の文章です。apt-get install foo を実行します\n\nソフトウェアー（ソフトウェア）",
    "中文文本 mixed with English 和数字 123 和 ａｂｃ full-width\n>>> print('你好')",
    "  leading and trailing  日本  \n\n\n末尾",
    "ΟΔΟΣ ΟΔΟΣ. İstanbul ΣΑΣ日本ΑΣ ÉCOLE straße",
    "ΟΔΟΣ ΟΔΟΣ. ΣΑΣ'Β Σ\u0301 ΑΣ\u200bΒ İstanbul ÉCOLE",
    "emoji 😀 beyond the BMP 😀日本 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def test_word_bounds_are_the_words():
    for text in TEXTS:
        view = TextView(text)
        starts, ends = view.word_bounds
        assert [text[a:b] for a, b in zip(starts.tolist(), ends.tolist())] == words(text)
        assert view.word_count == len(words(text))
        assert view.words_with(LETTER) == sum(re.search(r"[^\W\d_]", w) is not None for w in words(text))
        assert view.word_lines.tolist() == [text.count("\n", 0, a) for a in starts.tolist()]
        ids = view.word_ids.tolist()
        ws = words(text)
        assert len(ids) == len(ws)
        assert all((ids[i] == ids[j]) == (ws[i] == ws[j]) for i in range(len(ws)) for j in range(len(ws)))


def test_code_sign_finds_what_the_plain_pattern_finds():
    from kiln.data.gates.text import _CODE_SIGN

    plain = re.compile(r"=|\w\(|[{}\[\]<>]|--|::")
    lines = ["(", "a(", " (", "é(", "_(", "1(", "((", "x (y)", "f(x)", "a - b", "a -- b", "a: b", "a::b", "<b>",
             "日本(", "(a", "print 'x'", "a=b", "plain prose line", "", "—(", "))", "a\t("]
    lines += [f"{a}{b}{c}" for a in " a(:-=" for b in " (:-<" for c in " a(:-"]
    for line in lines:
        assert (_CODE_SIGN.search(line) is None) == (plain.search(line) is None), line
