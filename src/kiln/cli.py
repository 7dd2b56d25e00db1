"""The `kiln` command: parse, validate, dispatch. The work lives in the stage modules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln import __version__
from kiln.errors import IntegrityError, KilnError


def _split_overrides(values: list[str]) -> tuple[list[str], list[str]]:
    """Positional words with '=' are KEY=VALUE overrides; the rest are paths."""
    return [v for v in values if "=" not in v], [v for v in values if "=" in v]


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def cmd_run(args) -> int:
    from kiln.config import load_config
    from kiln.flow import run_all
    from kiln.summary import print_summary

    cfg = load_config(args.config, args.overrides)
    console = _console()
    result = run_all(cfg, log=console.print, until=args.until)
    print_summary(result, console)
    return 0


def cmd_data(args) -> int:
    from kiln.config import load_config
    from kiln.data.pipeline import run_data

    inputs, overrides = _split_overrides(args.inputs)
    cfg = load_config(args.config, overrides)
    if not inputs:
        raise KilnError("kiln data: give at least one INPUT file or glob")
    stats = run_data(inputs, Path(args.out), cfg.data, workers=args.workers)
    print(json.dumps(stats, indent=1, ensure_ascii=False))
    return 1 if stats["file_errors"] and len(stats["file_errors"]) == stats["files"] else 0


def cmd_tokenizer_train(args) -> int:
    from kiln.config import load_config
    from kiln.data.pipeline import read_docs
    from kiln.tokenizer import train_tokenizer

    cfg = load_config(args.config, args.overrides)
    tok = train_tokenizer(read_docs(Path(args.docs_dir)), Path(args.out), cfg.tokenizer, cfg.seed)
    print(json.dumps({"tokenizer": str(Path(args.out) / "tokenizer.json"), "vocab_size": tok.get_vocab_size()}))
    return 0


def cmd_pack(args) -> int:
    from kiln.config import load_config
    from kiln.data.pipeline import read_docs
    from kiln.shards.pack import pack

    cfg = load_config(args.config, args.overrides)
    m = pack(read_docs(Path(args.docs_dir)), Path(args.tokenizer), Path(args.out), cfg.pack)
    print(json.dumps({k: m[k] for k in ("dtype", "vocab_size", "seq_len", "splits", "packing_efficiency")}, indent=1))
    return 0


def cmd_train(args) -> int:
    from kiln.config import load_config
    from kiln.train.parallel import init_distributed, shutdown
    from kiln.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)  # validated before any process group forms
    d = init_distributed()
    try:
        summary = Trainer(cfg, d, log=_console().print if d.is_main else (lambda *_: None)).run()
        if d.is_main:
            print(json.dumps(summary))
    finally:
        shutdown()
    return 0


def cmd_eval(args) -> int:
    from kiln.eval import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(Path(args.checkpoint), Path(args.text) if args.text else None)))
    return 0


def cmd_ckpt_verify(args) -> int:
    from kiln.train.checkpoint import verify_checkpoint

    m = verify_checkpoint(Path(args.checkpoint))
    print(f"ok: {args.checkpoint} (step {m['step']}, {len(m['files'])} files match manifest.json)")
    return 0


def cmd_shards_verify(args) -> int:
    from kiln.shards.format import verify_shards

    m = verify_shards(Path(args.shards_dir))
    tokens = {s: v["tokens"] for s, v in m["splits"].items()}
    print(f"ok: {args.shards_dir} ({len(m['files'])} files match manifest.json; tokens {tokens})")
    return 0


def cmd_doctor(args) -> int:
    from kiln.ops.doctor import run_doctor

    return run_doctor(as_json=args.json, out_dir=Path(args.out_dir))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="From raw web crawls to a trained language model.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("run", help="every stage; re-running skips finished stages and resumes training")
    s.add_argument("config")
    s.add_argument("--until", choices=["data", "tokenizer", "pack", "train"], default="train",
                   help="stop after this stage (e.g. prepare shards here, then train under torchrun)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("data", help="WARC files -> cleaned, deduplicated documents")
    s.add_argument("inputs", nargs="+", metavar="INPUT", help="WARC files or globs, then optional KEY=VALUE overrides")
    s.add_argument("--out", required=True, help="the docs folder to write")
    s.add_argument("--config")
    s.add_argument("--workers", type=int, default=None)
    s.set_defaults(fn=cmd_data)

    tok = sub.add_parser("tokenizer", help="tokenizer commands").add_subparsers(dest="tok_command", required=True, metavar="ACTION")
    s = tok.add_parser("train", help="train a byte-level BPE tokenizer on a docs folder")
    s.add_argument("docs_dir")
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_tokenizer_train)

    s = sub.add_parser("pack", help="encode documents and pack them into token shards")
    s.add_argument("docs_dir")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_pack)

    s = sub.add_parser("train", help="train (also under torchrun --nproc_per_node=N -m kiln train CONFIG)")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("eval", help='print {"loss", "perplexity", "tokens"} of a checkpoint')
    s.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    s.add_argument("--text", metavar="FILE", help="a UTF-8 text file instead of the validation shards")
    s.set_defaults(fn=cmd_eval)

    ck = sub.add_parser("ckpt", help="checkpoint commands").add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    s = ck.add_parser("verify", help="exit 0 when every file matches the manifest, else 1 naming the file")
    s.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    s.set_defaults(fn=cmd_ckpt_verify)

    sh = sub.add_parser("shards", help="token shard commands").add_subparsers(dest="shards_command", required=True, metavar="ACTION")
    s = sh.add_parser("verify", help="exit 0 when every shard matches the manifest, else 1 naming the file")
    s.add_argument("shards_dir", metavar="SHARDS_DIR")
    s.set_defaults(fn=cmd_shards_verify)

    s = sub.add_parser("doctor", help="environment fingerprint and checks")
    s.add_argument("--json", action="store_true")
    s.add_argument("--out-dir", default=".", help="where the run will write (checked for free space)")
    s.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # KEY=VALUE overrides may also come after the options (argparse alone would refuse them there).
    args, extra = parser.parse_known_args(argv)
    if extra and not all("=" in e and not e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "inputs"):
        args.inputs += extra
    elif extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    if not hasattr(args, "config"):
        args.config = None
    if not hasattr(args, "overrides"):
        args.overrides = []
    try:
        return args.fn(args)
    except IntegrityError as exc:
        print(f"kiln: verification failed: {exc}", file=sys.stderr)
        return 1
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
