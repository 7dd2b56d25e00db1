"""Byte-level BPE tokenizer (HF `tokenizers`): train on a seeded sample of the corpus, save, load.

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
from kiln.manifest import (MANIFEST, STAGE_COMMANDS, read_manifest, sha256_file, staging_dir, write_atomic,
                           write_manifest, writes_folder)
from kiln.names import listed_name

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
TOKENIZER_FILE = "tokenizer.json"


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
    return _literal_specials(tok)


def _literal_specials(tok: Tokenizer) -> Tokenizer:
    # Text that spells "<|eos|>" must stay text: a crawled page must not inject document boundaries.
    # tokenizer.json does not store this switch, so it is set on every load too.
    tok.encode_special_tokens = True
    return tok


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


# --- bring your own tokenizer -----------------------------------------------------------------

NAME_KEYS = ("bos_token", "eos_token", "pad_token")
DEFAULT_NAMES = dict(zip(NAME_KEYS, (BOS, EOS, PAD)))


def special_tokens_in(tok: Tokenizer) -> list[str]:
    return [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]


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


def special_names(tokenizer_dir: str | Path) -> dict[str, str | None]:
    """{bos_token, eos_token, pad_token} of a committed tokenizer folder (its manifest); Kiln's own names for a
    bare tokenizer.json or a folder written before the names were recorded."""
    folder = Path(tokenizer_dir)
    if folder.is_dir() and (folder / "manifest.json").is_file():
        m = read_manifest(folder)
        if "eos_token" in m:
            return {k: m.get(k) for k in NAME_KEYS}
    return dict(DEFAULT_NAMES)


def add_domain_terms(tok: Tokenizer, terms: list[str]) -> None:
    """Each term becomes one token wherever it appears (matched before byte-level splitting)."""
    for term in terms:
        if not term or term in SPECIAL_TOKENS:
            raise KilnError(f"tokenizer.added_tokens: {term!r} cannot be a domain term; remove it from the config")
    tok.add_tokens([AddedToken(term, normalized=False, special=False) for term in terms])


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json of a tokenizer folder, or `path` itself when it names a file. A folder Kiln committed
    (it has a manifest.json) is read through its manifest first: its tokenizer.json must be a file the manifest
    lists, inside the folder (`kiln.names`), before it is opened."""
    path = Path(path)
    if path.is_file() or (path.suffix and not path.is_dir()):  # a file (or one that is missing: the caller says so)
        return path
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        if TOKENIZER_FILE not in manifest["files"] and not (path / TOKENIZER_FILE).exists():  # another stage's
            stage = manifest.get("stage")
            raise KilnError(f"{path} is not a tokenizer folder: it holds a `{STAGE_COMMANDS.get(stage, stage)}` "
                            f"output, with no {TOKENIZER_FILE}; pass a tokenizer folder ({{out_dir}}/tokenizer), "
                            f"a checkpoint folder or a {TOKENIZER_FILE}")
        return listed_name(path, TOKENIZER_FILE, manifest["files"], path / MANIFEST)
    return path / TOKENIZER_FILE


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load from a tokenizer folder or a tokenizer.json file."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise KilnError(f"no tokenizer at {file}; run `kiln tokenizer train DOCS_DIR --out DIR` first")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file that is not a tokenizer
        raise KilnError(f"{file}: not a valid tokenizer.json ({str(exc)[:120]})") from None
    return _literal_specials(tok)


def tokenizer_sha256(path: str | Path) -> str:
    file = tokenizer_file(path)
    if not file.is_file():
        raise KilnError(f"no tokenizer at {file}; prepare the data first: `kiln run CONFIG --until pack` "
                        "(or `kiln tokenizer train DOCS_DIR --out DIR`), or set tokenizer.path to your own "
                        "tokenizer.json")
    return sha256_file(file)


def special_id(tok: Tokenizer, token: str, key: str = "eos_token") -> int:
    ident = tok.token_to_id(token) if token else None
    if ident is None:
        have = ", ".join(special_tokens_in(tok)) or "none"
        raise KilnError(f"the tokenizer has no {token!r} token; set tokenizer.{key} to one of its special tokens "
                        f"({have}), or train one with `kiln tokenizer train`")
    return ident


def eos_id(tok: Tokenizer, name: str = EOS) -> int:
    return special_id(tok, name, "eos_token")


def pad_id(tok: Tokenizer, name: str | None = PAD) -> int:
    return special_id(tok, name, "pad_token")

