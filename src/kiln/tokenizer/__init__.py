"""The tokenizer: build.py trains a byte-level BPE on a seeded sample of the corpus (or adopts a given
tokenizer.json) into a committed folder; files.py reads a folder or file back, with its special tokens."""

from kiln.tokenizer.build import add_domain_terms, new_tokenizer, sample_documents, train_tokenizer, use_tokenizer
from kiln.tokenizer.files import (BOS, DEFAULT_NAMES, EOS, NAME_KEYS, PAD, SPECIAL_TOKENS, TOKENIZER_FILE, eos_id,
                                  load_tokenizer, pad_id, special_id, special_names, special_tokens_in, tokenizer_file,
                                  tokenizer_sha256)

__all__ = ["BOS", "DEFAULT_NAMES", "EOS", "NAME_KEYS", "PAD", "SPECIAL_TOKENS", "TOKENIZER_FILE", "add_domain_terms",
           "eos_id", "load_tokenizer", "new_tokenizer", "pad_id", "sample_documents", "special_id", "special_names",
           "special_tokens_in", "tokenizer_file", "tokenizer_sha256", "train_tokenizer", "use_tokenizer"]
