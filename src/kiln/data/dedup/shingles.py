"""Shingles: the hashed token n-grams that both near-duplicate methods compare.

Tokens are words, with each Han/kana character a word of its own (`auto`, so Chinese and
Japanese get character n-grams), or every non-space character (`char`). Text is lower-cased
first. Each token is hashed with xxh3-64; an n-gram's hash is a polynomial of its tokens'
hashes computed with numpy over the whole document (wrapping uint64 arithmetic).

The tokens are never made as strings: they are found as byte ranges of the text's words joined by
single spaces in UTF-8 (`exact.spaced_text`, the bytes the exact key hashes), and the tokens of up
to 16 bytes (98% of real text's) are hashed all at once by `_xxh3_short`, numpy's transcription of
xxh3-64 for such lengths (2-4x faster than a call per distinct token; tests check it against xxhash).
"""

from __future__ import annotations

import re

import numpy as np
import xxhash

from kiln.data.dedup.exact import spaced_text
from kiln.data.gates.text import _CJK, _CJK_CHAR, words

MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2^64
# `_CJK`'s ranges ("a-bc-d..."), as bounds for np.searchsorted: a code point is Han/kana when its place is odd
_CJK_BOUNDS = np.array([ord(_CJK[i + k]) + k // 2 for i in range(0, len(_CJK), 3) for k in (0, 2)])


def tokens(text: str, mode: str = "auto") -> list[str]:
    return lowered_tokens(text.lower(), mode)


def lowered_tokens(low: str, mode: str = "auto", split: list[str] | None = None) -> list[str]:
    """`tokens` of a text already lower-cased; `split`: `low.split()`, when the caller has made it."""
    if mode == "char":
        return re.findall(r"\S", low)
    if mode == "word" or _CJK_CHAR.search(low) is None:  # `words`' own test: then it is the whitespace split
        return low.split() if split is None else split
    return words(low)


def shingle_hashes(text: str, n: int = 5, mode: str = "auto") -> np.ndarray:
    """Sorted unique uint64 hashes of the document's token n-grams (one shingle if it has fewer tokens)."""
    return spaced_shingles(spaced_text(text.lower()), n, mode)


def spaced_shingles(spaced: bytes, n: int = 5, mode: str = "auto") -> np.ndarray:
    """`shingle_hashes` of a text whose lower-cased `exact.spaced_text` is `spaced`."""
    h = spaced_token_hashes(spaced, mode)
    if not len(h):
        return h
    n = min(n, len(h))
    acc = h[: len(h) - n + 1].copy()
    with np.errstate(over="ignore"):
        for j in range(1, n):
            acc *= MULT
            acc += h[j: len(h) - n + 1 + j]
    return sorted_unique(acc)


def spaced_token_hashes(spaced: bytes, mode: str = "auto") -> np.ndarray:
    """xxh3-64 of each of `tokens(text, mode)`, in order, from the text's `spaced` words."""
    if not spaced:
        return np.empty(0, dtype=np.uint64)
    if len(spaced) < _SHORT and mode != "char" and (mode == "word" or _MAYBE_CJK.search(spaced) is None):
        # a short page of words alone: one xxhash call a word beats the ~60 numpy calls below (a page of ~1 KB of
        # text, the real-text dedup benchmark's, took 2x as long the numpy way)
        words = spaced.split(b" ")
        return np.fromiter(map(xxhash.xxh3_64_intdigest, words), dtype=np.uint64, count=len(words))
    raw = np.frombuffer(spaced, dtype=np.uint8)
    starts, ends = token_bounds(raw, mode)
    lens = ends - starts
    out = _xxh3_short(raw, starts, lens)
    for i in np.flatnonzero(lens > 16).tolist():  # 2% of real text's tokens
        out[i] = xxhash.xxh3_64_intdigest(spaced[starts[i]:ends[i]])
    return out


_SHORT = 8192  # bytes of spaced text under which the words are hashed one call each
_MAYBE_CJK = re.compile(rb"[\xe3-\xef]")  # a Han/kana character's first byte (token_bounds tells them apart)


def token_bounds(raw: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Where each token starts and ends in `raw` (a text's words joined by single spaces, UTF-8): each word
    (`word`; `auto` without Han/kana), each Han/kana character and each run between them inside a word (`auto`,
    `words`' `_WORD`), or each character but the spaces (`char`)."""
    size = len(raw)
    if mode == "char":
        begins = np.flatnonzero((raw & 0xC0) != 0x80)  # every character's first byte
        ends = np.append(begins[1:], size)
        kept = raw[begins] != 0x20
        return begins[kept], ends[kept]
    spaces = np.flatnonzero(raw == 0x20)
    # Han/kana (U+3040..U+FF9F) are 3-byte characters whose first byte is E3..EF: none of those, none of them
    lead = np.flatnonzero(raw >= 0xE3) if mode == "auto" and size else np.empty(0, dtype=np.intp)
    if len(lead):
        lead = lead[raw[lead] <= 0xEF]
        code = ((raw[lead] & 0x0F).astype(np.int32) << 12 | (raw[lead + 1] & 0x3F).astype(np.int32) << 6
                | raw[lead + 2] & 0x3F)
        lead = lead[np.searchsorted(_CJK_BOUNDS, code, side="right") % 2 == 1]
    if not len(lead):
        return np.append(0, spaces + 1), np.append(spaces, size)
    cut = np.zeros(size + 1, dtype=bool)  # a token starts or ends at each cut
    for at in (0, size, spaces, spaces + 1, lead, lead + 3):
        cut[at] = True
    at = np.flatnonzero(cut)
    kept = raw[at[:-1]] != 0x20  # what lies between two cuts is a token or a space
    return at[:-1][kept], at[1:][kept]


_SECRET = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
                        "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c")  # xxh3's, first 64


def _secret(at: int, size: int = 8) -> int:
    return int.from_bytes(_SECRET[at:at + size], "little")


_U = np.uint64
_FLIP_1TO3, _FLIP_4TO8 = _U(_secret(0, 4) ^ _secret(4, 4)), _U(_secret(8) ^ _secret(16))
_FLIP_9TO16 = (_U(_secret(24) ^ _secret(32)), _U(_secret(40) ^ _secret(48)))
_PRIME64_2, _PRIME64_3 = _U(0xC2B2AE3D27D4EB4F), _U(0x165667B19E3779F9)
_PRIME_MX1, _PRIME_MX2, _LOW32 = _U(0x165667919E3779F9), _U(0x9FB21C651E98DF25), _U(0xFFFFFFFF)


def _xxh3_short(raw: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """xxh3-64 (seed 0) of each raw[start:start + len] of 1 to 16 bytes, as xxhash's XXH3_len_1to3_64b,
    XXH3_len_4to8_64b and XXH3_len_9to16_64b compute it; other lengths' places are left unset."""
    out = np.empty(len(starts), dtype=np.uint64)
    with np.errstate(over="ignore"):
        i = np.flatnonzero(lens <= 3)
        if len(i):
            s, n = starts[i], lens[i]
            h = raw[s].astype(np.uint64) << _U(16)
            h |= raw[s + (n >> 1)].astype(np.uint64) << _U(24)
            h |= raw[s + n - 1]
            h |= n.astype(np.uint64) << _U(8)
            h ^= _FLIP_1TO3
            h ^= h >> _U(33)  # XXH64_avalanche
            h *= _PRIME64_2
            h ^= h >> _U(29)
            h *= _PRIME64_3
            out[i] = h ^ (h >> _U(32))
        i = np.flatnonzero((lens >= 4) & (lens <= 8))
        if len(i):
            s, n = starts[i], lens[i]
            le32 = np.ndarray((len(raw) - 3,), "<u4", raw, 0, (1,))  # 4 bytes from each place (unaligned)
            h = le32[s].astype(np.uint64) << _U(32)
            h += le32[s + n - 4]
            h ^= _FLIP_4TO8
            h ^= ((h << _U(49)) | (h >> _U(15))) ^ ((h << _U(24)) | (h >> _U(40)))  # XXH3_rrmxmx
            h *= _PRIME_MX2
            h ^= (h >> _U(35)) + n.astype(np.uint64)
            h *= _PRIME_MX2
            out[i] = h ^ (h >> _U(28))
        i = np.flatnonzero((lens >= 9) & (lens <= 16))
        if len(i):
            s, n = starts[i], lens[i]
            le64 = np.ndarray((len(raw) - 7,), "<u8", raw, 0, (1,))
            lo = le64[s] ^ _FLIP_9TO16[0]
            hi = le64[s + n - 8] ^ _FLIP_9TO16[1]
            # XXH3_mul128_fold64: lo * hi to 128 bits from 32-bit halves, its low 64 bits xor its high 64
            a0, a1, b0, b1 = lo & _LOW32, lo >> _U(32), hi & _LOW32, hi >> _U(32)
            ll, hl, lh = a0 * b0, a1 * b0, a0 * b1
            cross = (ll >> _U(32)) + (hl & _LOW32) + lh
            h = n.astype(np.uint64) + lo.byteswap() + hi
            h += ((cross << _U(32)) | (ll & _LOW32)) ^ ((hl >> _U(32)) + (cross >> _U(32)) + a1 * b1)
            h ^= h >> _U(37)  # XXH3_avalanche
            h *= _PRIME_MX1
            out[i] = h ^ (h >> _U(32))
    return out


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of a 1-d array, sorting it in place: a sort and a mask, where numpy 2.4's np.unique takes ~10x
    as long on a page's uint64 shingles (0.19 against 0.02 CPU s for the Debian crawl's 1.9 M)."""
    values.sort()
    first = np.empty(len(values), dtype=bool)
    first[:1] = True
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return values[first]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique shingle arrays."""
    if not len(a) and not len(b):
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)
