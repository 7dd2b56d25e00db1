"""Byte-level BPE tokenizer (HF `tokenizers`): trained on a seeded sample of the corpus, or a given one adopted,
into a committed tokenizer folder.

Byte-level pre-tokenization with no normaliser makes encoding lossless:
decode(encode(text)) == text for any Unicode string. Domain terms from
`tokenizer.added_tokens` are added after training, each kept whole as one
token. The saved tokenizer.json loads in `transformers.PreTrainedTokenizerFast(tokenizer_file=...)`
with the same ids (except that transformers turns text spelling `<|eos|>` into the special token).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.config import TokenizerConfig
from kiln.errors import KilnError
from kiln.manifest import staging_dir, write_atomic, write_manifest, writes_folder
from kiln.tokenizer.files import (BOS, DEFAULT_NAMES, EOS, NAME_KEYS, PAD, SPECIAL_TOKENS, TOKENIZER_FILE,
                                  literal_specials, load_tokenizer, special_tokens_in, tokenizer_file)


def sample_documents(docs: Iterable[dict], max_docs: int, seed: int) -> list[dict]:
    """Reservoir sample of at most `max_docs` documents, seeded: the same corpus gives the same sample.

    One streaming pass over `docs` (the docs folder is read part by part); memory holds the sample,
    at most `max_docs` documents, never the corpus."""
    rng = random.Random(seed)
    sample: list[dict] = []
    for i, doc in enumerate(docs):
        if i < max_docs:
            sample.append(doc)
        elif (j := rng.randrange(i + 1)) < max_docs:
            sample[j] = doc
    return sample



def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return literal_specials(tok)



@writes_folder("tokenizer", out="out", inputs=("docs",))
def train_tokenizer(
    docs: Iterable[dict], out: Path, cfg: TokenizerConfig, seed: int, fingerprint: str = ""
) -> Tokenizer:
    """Train on a seeded sample of `docs`; commit tokenizer.json, the sample's ids and a manifest to `out`."""
    sample = sample_documents(docs, cfg.max_docs, seed)
    if not sample:
        raise KilnError("the docs folder holds no documents to train a tokenizer on; check the data stage's stats.json")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator((d["text"] for d in sample), trainer=trainer, length=len(sample))
    add_domain_terms(tok, cfg.added_tokens)
    with staging_dir(out) as tmp:
        tok.save(str(tmp / TOKENIZER_FILE))
        write_atomic(tmp / "training_docs.txt", "".join(d["id"] + "\n" for d in sample))
        write_manifest(tmp, stage="tokenizer", fingerprint=fingerprint, vocab_size=tok.get_vocab_size(),
                       special_tokens=SPECIAL_TOKENS, added_tokens=list(cfg.added_tokens), training_docs=len(sample),
                       seed=seed, **{k: v for k, v in zip(NAME_KEYS, (BOS, EOS, PAD))})
    return tok



@writes_folder("tokenizer", out="out")
def use_tokenizer(out: Path, cfg: TokenizerConfig, fingerprint: str = "") -> Tokenizer:
    """Commit `out` with the user's own tokenizer.json (tokenizer.path, copied byte for byte, so it stays the
    same file as a Hub model's) and the names of its special tokens (tokenizer.eos_token, ...).

    EOS is required (it ends every document in the shards). BOS and PAD are optional: a name left at Kiln's
    default that the tokenizer lacks is recorded as null; one the user set and the tokenizer lacks is an error."""
    file = tokenizer_file(cfg.path)
    tok = load_tokenizer(file)
    names: dict[str, str | None] = {}
    for key in NAME_KEYS:
        name = getattr(cfg, key)
        if name is not None and tok.token_to_id(name) is None:
            if key == "eos_token" or name != DEFAULT_NAMES[key]:
                have = ", ".join(special_tokens_in(tok)) or "none"
                raise KilnError(f"{file} has no token {name!r} (tokenizer.{key}); set tokenizer.{key} to one of its "
                                f"special tokens: {have}")
            name = None
        names[key] = name
    with staging_dir(out) as tmp:
        write_atomic(tmp / TOKENIZER_FILE, file.read_bytes())
        write_manifest(tmp, stage="tokenizer", fingerprint=fingerprint, vocab_size=tok.get_vocab_size(),
                       source=str(file), special_tokens=[n for n in names.values() if n], **names)
    return tok



def add_domain_terms(tok: Tokenizer, terms: list[str]) -> None:
    """Each term becomes one token wherever it appears (matched before byte-level splitting)."""
    for term in terms:
        if not term or term in SPECIAL_TOKENS:
            raise KilnError(f"tokenizer.added_tokens: {term!r} cannot be a domain term; remove it from the config")
    tok.add_tokens([AddedToken(term, normalized=False, special=False) for term in terms])
