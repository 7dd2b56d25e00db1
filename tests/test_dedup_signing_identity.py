"""The signatures step's faster forms (issue 44) give the values of the plain ones, bit for bit: numpy's xxh3-64
of the tokens found as byte ranges against one xxhash call per token, the shingle sets against the reference
(str tokens, one hash each, the n-gram polynomial), MinHash's one-function-at-a-time path against the blocked one."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.dedup.exact import spaced_text, text_key
from kiln.data.dedup.minhash import _CHUNK, _ONE_BY_ONE, MinHasher
from kiln.data.dedup.shingles import MULT, _xxh3_short, shingle_hashes, spaced_token_hashes, tokens

# words, Han/kana (and their neighbours U+303F, U+3100, U+FFA0), Hangul, symbols, emoji, wide spaces, a lone
# surrogate, and pieces long enough for every xxh3 length class and for xxhash's own (> 16 bytes)
ALPHABET = list("ab Z\t\n\u00a0\u3000\u2028\x1cé東京のカ\u303f\u3100\uffa0\uff66한😀.İΣ“") + ["\ud800"]
TEXTS = st.lists(st.sampled_from(ALPHABET + ["x" * 7, "ü" * 6, "y" * 15]), max_size=40).map("".join)


def reference_shingles(text: str, n: int, mode: str) -> np.ndarray:
    """shingle_hashes as it was made before issue 44: str tokens, xxh3-64 of each, the polynomial, np.unique."""
    toks = tokens(text, mode)
    if not toks:
        return np.empty(0, dtype=np.uint64)
    h = np.array([xxhash.xxh3_64_intdigest(t.encode("utf-8", "surrogatepass")) for t in toks], dtype=np.uint64)
    n = min(n, len(h))
    acc = h[: len(h) - n + 1].copy()
    with np.errstate(over="ignore"):
        for j in range(1, n):
            acc = acc * MULT + h[j: len(h) - n + 1 + j]
    return np.unique(acc)


def reference_signature(hasher: MinHasher, shingles: np.ndarray) -> np.ndarray:
    sig = np.full(len(hasher.a), np.iinfo(np.uint64).max, dtype=np.uint64)
    for x in shingles:
        with np.errstate(over="ignore"):
            np.minimum(sig, hasher.a * x + hasher.b, out=sig)
    return (sig >> np.uint64(32)).astype(np.uint32)


def test_xxh3_of_1_to_16_bytes_is_xxhash_s():
    rng = np.random.default_rng(7)
    parts = [bytes(rng.integers(0, 256, size=size, dtype=np.uint8)) for size in rng.integers(1, 17, size=5000)]
    parts += [bytes([b]) * size for b in (0, 0x20, 0xFF) for size in range(1, 17)]
    sizes = np.array([len(p) for p in parts])
    got = _xxh3_short(np.frombuffer(b"".join(parts), dtype=np.uint8), np.cumsum(sizes) - sizes, sizes)
    assert got.tolist() == [xxhash.xxh3_64_intdigest(p) for p in parts]


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, mode=st.sampled_from(["auto", "word", "char"]),
       n=st.integers(1, 6))
def test_token_hashes_and_shingles_are_the_reference_s(text, mode, n):
    low = text.lower()
    assert spaced_text(low) == " ".join(low.split()).encode("utf-8", "surrogatepass")
    want = [xxhash.xxh3_64_intdigest(t.encode("utf-8", "surrogatepass")) for t in tokens(text, mode)]
    assert spaced_token_hashes(spaced_text(low), mode).tolist() == want
    assert shingle_hashes(text, n, mode).tobytes() == reference_shingles(text, n, mode).tobytes()
    assert text_key(text) == xxhash.xxh3_128_digest(" ".join(low.split()).encode("utf-8", "surrogatepass"))


def test_minhash_signatures_are_the_same_on_both_paths():
    hasher = MinHasher(20, 6, 1)
    rng = np.random.default_rng(3)
    sizes = [1, 5, _ONE_BY_ONE - 1, _ONE_BY_ONE, _CHUNK + 3]
    for size in sizes:
        shingles = np.unique(rng.integers(0, 2**64 - 1, size=size, dtype=np.uint64, endpoint=True))
        got = hasher.signature(shingles)
        assert got.dtype == np.uint32 and got.tobytes() == reference_signature(hasher, shingles).tobytes(), size


def test_a_text_signed_again_is_looked_up_and_its_files_are_the_same():
    from kiln.config import DedupConfig
    from kiln.data.dedup import signatures
    from kiln.data.dedup.signatures import Signer, forget_signed

    texts = [f"page {i} " + "the same words again and again " * (i + 3) for i in range(6)]
    stream = texts + texts[::-1] + texts[:2]
    for method in ("minhash", "simhash", "none"):
        cfg = DedupConfig(method=method)
        forget_signed()
        plain, remembered = Signer(cfg), Signer(cfg, remember=4)
        for i, text in enumerate(stream):
            plain.add(f"d{i}", text)
            remembered.add(f"d{i}", text)
        assert remembered.files() == plain.files()  # every key, signature and id, byte for byte
        assert len(signatures._SIGNED[1]) == 4  # the last 4 texts signed, no more
    forget_signed()
    assert signatures._SIGNED is None
