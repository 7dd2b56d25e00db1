"""A tokenizer folder or tokenizer.json, read: the file (through a Kiln folder's manifest), the tokenizer, its
sha256, and its special tokens' names and ids."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from kiln.errors import KilnError
from kiln.manifest import MANIFEST, STAGE_COMMANDS, read_manifest, sha256_file
from kiln.names import listed_name

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
TOKENIZER_FILE = "tokenizer.json"
NAME_KEYS = ("bos_token", "eos_token", "pad_token")
DEFAULT_NAMES = dict(zip(NAME_KEYS, (BOS, EOS, PAD)))


def special_tokens_in(tok: Tokenizer) -> list[str]:
    return [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]



def special_names(tokenizer_dir: str | Path) -> dict[str, str | None]:
    """{bos_token, eos_token, pad_token} of a committed tokenizer folder (its manifest); Kiln's own names for a
    bare tokenizer.json or a folder written before the names were recorded."""
    folder = Path(tokenizer_dir)
    if folder.is_dir() and (folder / "manifest.json").is_file():
        m = read_manifest(folder)
        if "eos_token" in m:
            return {k: m.get(k) for k in NAME_KEYS}
    return dict(DEFAULT_NAMES)



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



def literal_specials(tok: Tokenizer) -> Tokenizer:
    # Text that spells "<|eos|>" must stay text: a crawled page must not inject document boundaries.
    # tokenizer.json does not store this switch, so it is set on every load too.
    tok.encode_special_tokens = True
    return tok



def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load from a tokenizer folder or a tokenizer.json file."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise KilnError(f"no tokenizer at {file}; run `kiln tokenizer train DOCS_DIR --out DIR` first")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file that is not a tokenizer
        raise KilnError(f"{file}: not a valid tokenizer.json ({str(exc)[:120]})") from None
    return literal_specials(tok)



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
