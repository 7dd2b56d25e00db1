"""`kiln data` (and `data explain`, `data classifier train`), `kiln tokenizer train`, `kiln pack` and
`kiln shards verify | inspect`: the commands that make and check the data a run trains on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kiln.commands.args import example, split_overrides
from kiln.errors import KilnError


def add_data(sub) -> None:
    s = sub.add_parser("data", help="WARC/JSONL/Parquet files -> cleaned, deduplicated documents; "
                       "`kiln data explain DOC_ID_OR_URL --out DIR` tells what happened to one",
                       epilog=example("kiln data 'crawl/*.warc.gz' --out out/docs -- data.languages=[en]      "
                                      "(after --, every word is an override; before it, any path)"))
    s.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, globs or fsspec URLs (s3://...), then optional KEY=VALUE overrides",
    )
    s.add_argument("--out", required=True, help="the docs folder to write (for explain: to read)")
    s.add_argument("--config")
    s.add_argument("--workers", type=int, default=None, help="processes (or Ray tasks at once); default data.workers")
    s.add_argument("--lang-model", metavar="PATH", help="your own fastText language-ID model (sets data.lang_model)")
    s.add_argument("--docs-format", choices=["jsonl", "parquet"], help="jsonl (part-NNNNN.jsonl.zst) or parquet (the "
                   "Hub's layout: data/train-NNNNN-of-MMMMM.parquet); sets data.docs_format")
    s.add_argument("--positive", nargs="+", metavar="PATH", help="`kiln data classifier train --positive PATHS "
                   "--negative PATHS --out MODEL`: good documents (docs folders, JSONL or text files)")
    s.add_argument("--negative", nargs="+", metavar="PATH", help="classifier train: the documents to score low")
    s.set_defaults(fn=cmd_data)


def cmd_data(args) -> int:
    from kiln.config import load_config
    from kiln.stages import StageLog, make_docs

    if args.inputs[:1] == ["explain"]:  # `kiln data explain DOC_ID_OR_URL --out DIR` (a file named explain: ./explain)
        return cmd_data_explain(args.inputs[1:], Path(args.out))  # a URL may hold '=': not an override here
    if args.inputs[:2] == ["classifier", "train"]:
        return cmd_data_classifier_train(args)
    inputs, overrides = (args.inputs, []) if args.explicit else split_overrides(args.inputs)
    overrides += args.set_overrides
    if args.lang_model:
        overrides.append(f"data.lang_model={args.lang_model}")
    if args.docs_format:
        overrides.append(f"data.docs_format={args.docs_format}")
    cfg = load_config(args.config, overrides)
    if not inputs:
        raise KilnError("kiln data: give at least one INPUT file or glob")
    if args.workers is not None and args.workers < 1:
        raise KilnError(f"kiln data: --workers must be at least 1, got {args.workers}")
    said = StageLog(lambda line: None)  # the progress bar tells the work; a skip is said below
    stats = make_docs(inputs, Path(args.out), cfg.data, said, workers=args.workers, progress=True)
    say_skipped(said, "kiln data", args.out, "inputs and data settings")
    print(json.dumps(stats, indent=1, ensure_ascii=False))
    for err in stats["file_errors"]:  # also in stats.json; a line each, where the user looks
        print(f"kiln: warning: {err['error']}", file=sys.stderr)
    return 1 if stats["file_errors"] and len(stats["file_errors"]) == stats["files"] else 0


def say_skipped(said, command: str, out, inputs: str) -> None:
    """One line when the stage found `out` complete for the same inputs (kept, as `kiln run` keeps it)."""
    if said.skipped:
        print(f"{command}: {out} is complete and up to date (same {inputs}): not written again", file=sys.stderr)


def cmd_data_classifier_train(args) -> int:
    """`kiln data classifier train --positive PATHS --negative PATHS --out MODEL`."""
    from kiln.data.gates.classifier import train

    if not args.positive or not args.negative or len(args.inputs) > 2:
        raise KilnError("kiln data classifier train: give --positive PATHS and --negative PATHS (docs folders, "
                        "JSONL or text files) and --out MODEL")
    counts = train(args.positive, args.negative, Path(args.out))
    print(json.dumps({"model": args.out, **counts}))
    return 0


def cmd_data_explain(keys: list[str], docs_dir: Path) -> int:
    from kiln.data.explain import explain

    if len(keys) != 1:
        raise KilnError(
            "kiln data explain: give exactly one DOC_ID_OR_URL, "
            "e.g. kiln data explain https://example.org/ --out out/docs"
        )
    print(explain(keys[0], docs_dir))
    return 0


def add_tokenizer(sub) -> None:
    tok = sub.add_parser("tokenizer", help="tokenizer commands").add_subparsers(
        dest="tok_command", required=True, metavar="ACTION"
    )
    s = tok.add_parser("train", help="train a byte-level BPE tokenizer on a docs folder",
                       epilog=example("kiln tokenizer train out/tiny/docs --out out/tok tokenizer.vocab_size=8192"))
    s.add_argument("docs_dir")
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_tokenizer_train)


def cmd_tokenizer_train(args) -> int:
    from kiln.config import load_config
    from kiln.stages import StageLog, make_tokenizer
    from kiln.tokenizer import tokenizer_file

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    said = StageLog(lambda line: None)
    manifest = make_tokenizer(cfg, Path(args.docs_dir), out, said)
    say_skipped(said, "kiln tokenizer train", out, "documents and tokenizer settings")
    print(json.dumps({"tokenizer": str(tokenizer_file(out)), "vocab_size": manifest["vocab_size"],
                      **({"source": cfg.tokenizer.path} if cfg.tokenizer.path else {})}))
    return 0


def add_pack(sub) -> None:
    s = sub.add_parser("pack", help="encode documents and pack them into token shards",
                       epilog=example("kiln pack out/tiny/docs --tokenizer out/tiny/tokenizer --out out/shards "
                                      "pack.seq_len=512"))
    s.add_argument("docs_dir")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("--format", choices=["kiln", "megatron", "olmo-core"],
                   help="kiln: Kiln's shards (kiln train); megatron: Megatron-LM's .bin/.idx; olmo-core: OLMo-core's "
                        "token files (as pack.format; docs/formats.md)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_pack)


def cmd_pack(args) -> int:
    from kiln.config import load_config
    from kiln.stages import StageLog, make_shards

    cfg = load_config(args.config, args.overrides + ([f"pack.format={args.format}"] if args.format else []))
    said = StageLog(lambda line: None)
    m = make_shards(cfg, Path(args.docs_dir), Path(args.tokenizer), Path(args.out), said)
    say_skipped(said, "kiln pack", args.out, "documents, tokenizer and pack settings")
    print(json.dumps({k: m[k] for k in ("dtype", "vocab_size", "seq_len", "splits", "packing_efficiency")}, indent=1))
    return 0


def add_shards(sub) -> None:
    sh = sub.add_parser("shards", help="token shard commands").add_subparsers(
        dest="shards_command", required=True, metavar="ACTION"
    )
    s = sh.add_parser("verify", help="exit 0 when every shard matches the manifest, else 1 naming the file",
                      epilog=example("kiln shards verify out/tiny/shards"))
    s.add_argument("shards_dir", metavar="SHARDS_DIR")
    s.set_defaults(fn=cmd_shards_verify)
    s = sh.add_parser("inspect", help="decode one sequence and list the documents (url, source, offset) it came from",
                      epilog=example("kiln shards inspect out/tiny/shards --at 0"))
    s.add_argument("shards_dir", metavar="SHARDS_DIR")
    s.add_argument("--at", type=int, required=True, metavar="SEQUENCE_INDEX")
    s.add_argument("--split", default="train", choices=["train", "val"])
    s.add_argument("--tokenizer", help="tokenizer folder or tokenizer.json (default: tokenizer/ beside SHARDS_DIR)")
    s.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s.set_defaults(fn=cmd_shards_inspect)


def cmd_shards_verify(args) -> int:
    from kiln.shards.format import verify_shards

    m = verify_shards(Path(args.shards_dir))
    tokens = {s: v["tokens"] for s, v in m["splits"].items()}
    print(f"ok: {args.shards_dir} ({len(m['files'])} files match manifest.json; tokens {tokens})")
    return 0


def cmd_shards_inspect(args) -> int:
    from kiln.shards.inspect import format_inspection, inspect_sample

    info = inspect_sample(Path(args.shards_dir), args.split, args.at, Path(args.tokenizer) if args.tokenizer else None)
    print(json.dumps(info, ensure_ascii=False) if args.json else format_inspection(info))
    return 0
