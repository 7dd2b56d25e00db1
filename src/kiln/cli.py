"""The `kiln` command: parse, validate, dispatch. The work lives in the stage modules."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from kiln import __version__
from kiln.errors import IntegrityError, KilnError


def _is_override(word: str) -> bool:
    """KEY=VALUE, unless the word names an existing file (a Hive-style path such as lang=en/part-0.parquet)."""
    return "=" in word and not word.startswith("-") and not Path(word).exists()


def _split_overrides(values: list[str]) -> tuple[list[str], list[str]]:
    """Positional words with '=' are KEY=VALUE overrides; the rest are paths (after `--`, see main)."""
    return [v for v in values if not _is_override(v)], [v for v in values if _is_override(v)]


def _explicit_overrides(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Take `--set KEY=VALUE` (repeatable) and everything after `--` out of argv as overrides.

    With either, positional words are never read as overrides, so any path (one holding '=') works:
    `kiln data 'lang=en/*.parquet' --out docs -- data.min_chars=100`. None when neither is used."""
    words, overrides, explicit = [], [], False
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            overrides += argv[i + 1:]
            explicit = True
            break
        if word == "--set" and i + 1 < len(argv):
            overrides.append(argv[i + 1])
            explicit, i = True, i + 2
            continue
        if word.startswith("--set="):
            overrides.append(word[len("--set="):])
            explicit = True
        else:
            words.append(word)
        i += 1
    return words, (overrides if explicit else None)


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
    from rich.console import Console

    again = shlex.join([args.config, *(o for o in args.overrides if not o.startswith("train.max_steps="))])
    print_summary(result, Console(stderr=True, highlight=False, width=max(console.width, 110)), config=again)
    return 0


def cmd_data(args) -> int:
    from kiln.config import load_config
    from kiln.data.pipeline import run_data

    if args.inputs[:1] == ["explain"]:  # `kiln data explain DOC_ID_OR_URL --out DIR` (a file named explain: ./explain)
        return cmd_data_explain(args.inputs[1:], Path(args.out))  # a URL may hold '=': not an override here
    if args.inputs[:2] == ["classifier", "train"]:
        return cmd_data_classifier_train(args)
    inputs, overrides = (args.inputs, []) if args.explicit else _split_overrides(args.inputs)
    overrides += args.set_overrides
    if args.lang_model:
        overrides.append(f"data.lang_model={args.lang_model}")
    cfg = load_config(args.config, overrides)
    if not inputs:
        raise KilnError("kiln data: give at least one INPUT file or glob")
    if args.workers is not None and args.workers < 1:
        raise KilnError(f"kiln data: --workers must be at least 1, got {args.workers}")
    stats = run_data(inputs, Path(args.out), cfg.data, workers=args.workers, progress=True)
    print(json.dumps(stats, indent=1, ensure_ascii=False))
    for err in stats["file_errors"]:  # also in stats.json; a line each, where the user looks
        print(f"kiln: warning: {err['error']}", file=sys.stderr)
    return 1 if stats["file_errors"] and len(stats["file_errors"]) == stats["files"] else 0


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


def cmd_tokenizer_train(args) -> int:
    from kiln.config import load_config
    from kiln.data.docs import read_docs
    from kiln.data.rejections import docs_stats, few_documents_message
    from kiln.tokenizer import train_tokenizer

    cfg = load_config(args.config, args.overrides)
    stats = Path(args.docs_dir) / "stats.json"
    if stats.is_file() and (few := few_documents_message(docs_stats(args.docs_dir), Path(args.docs_dir))):
        raise KilnError(few)
    tok = train_tokenizer(read_docs(Path(args.docs_dir)), Path(args.out), cfg.tokenizer, cfg.seed)
    print(json.dumps({"tokenizer": str(Path(args.out) / "tokenizer.json"), "vocab_size": tok.get_vocab_size()}))
    return 0


def cmd_pack(args) -> int:
    from kiln.config import load_config
    from kiln.data.docs import read_docs
    from kiln.shards.pack import pack

    from kiln.data.tables import down_weighted

    cfg = load_config(args.config, args.overrides)
    docs = Path(args.docs_dir)
    weights = down_weighted(docs) if (docs / "manifest.json").is_file() else None
    m = pack(read_docs(docs), Path(args.tokenizer), Path(args.out), cfg.pack, source_weights=weights)
    print(json.dumps({k: m[k] for k in ("dtype", "vocab_size", "seq_len", "splits", "packing_efficiency")}, indent=1))
    return 0


def cmd_train(args) -> int:
    from kiln.config import load_config
    from kiln.train.parallel import init_distributed, shutdown
    from kiln.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)  # validated before any process group forms
    d = init_distributed(cfg.parallel.startup_timeout_s, cfg.out / "run")
    try:
        summary = Trainer(cfg, d, log=_console().print if d.is_main else (lambda *_: None)).run()
        if d.is_main:
            print(json.dumps(summary))
    finally:
        shutdown()
    return 0


def _checkpoint(path: str) -> Path:
    """A checkpoint folder, or the newest valid one of a run folder (named on stderr)."""
    from kiln.train.resolve import resolve_checkpoint

    return resolve_checkpoint(path, log=_console().print)


def cmd_eval(args) -> int:
    from kiln.eval import evaluate_checkpoint

    if args.mc:
        from kiln.eval.mc import evaluate_mc_checkpoint, load_questions

        load_questions(args.mc)  # a bad task file is named before the checkpoint is looked for
        print(json.dumps({"mc": evaluate_mc_checkpoint(_checkpoint(args.checkpoint), Path(args.mc))}))
        return 0
    print(json.dumps(evaluate_checkpoint(_checkpoint(args.checkpoint), Path(args.text) if args.text else None)))
    return 0


def cmd_generate(args) -> int:
    from kiln.eval.generate import generate_from_checkpoint

    out = generate_from_checkpoint(_checkpoint(args.checkpoint), args.prompt, args.max_new_tokens, args.temperature,
                                   args.top_k, args.seed)
    print(out.prompt + out.text)
    return 0


def cmd_ckpt_verify(args) -> int:
    from kiln.train.checkpoint import verify_checkpoint

    m = verify_checkpoint(Path(args.checkpoint))
    print(f"ok: {args.checkpoint} (step {m['step']}, {len(m['files'])} files match manifest.json)")
    return 0


def cmd_ckpt_list(args) -> int:
    from kiln.train.checkpoint import checkpoint_table

    run = Path(args.run_dir)
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    rows = checkpoint_table(root, args.public_key)
    if not rows:
        raise KilnError(f"{root}: no checkpoints; pass a run folder ({{out_dir}}/run) or its checkpoints/ folder")
    for r in rows:
        name = Path(r["path"]).name
        if r["valid"]:
            val = f" val_loss {r['val_loss']:.4f}" if r.get("val_loss") is not None else ""
            print(f"{name}  valid    step {r['step']} tokens {r['tokens_seen']}{val}")
        elif r["step"] is None:
            print(f"{name}  skipped  {r['problem']}")
        else:
            print(f"{name}  INVALID  {r['problem']}")
    return 0


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


def cmd_doctor(args) -> int:
    from kiln.config import load_config
    from kiln.ops.doctor import run_doctor

    cfg = load_config(args.config, args.overrides) if (args.config or args.overrides) else None
    if args.allreduce:
        from kiln.ops.doctor import run_group_allreduce

        return run_group_allreduce(cfg, as_json=args.json)
    return run_doctor(cfg, Path(args.out_dir) if args.out_dir else None, as_json=args.json,
                      against=Path(args.against) if args.against else None)


def cmd_preflight(args) -> int:
    from kiln.config import load_config
    from kiln.ops.preflight import run_preflight

    return run_preflight(load_config(args.config, args.overrides), as_json=args.json)


def cmd_plan(args) -> int:
    from kiln.config import load_config
    from kiln.ops.plan import make_plan, print_plan

    plan = make_plan(load_config(args.config, args.overrides))
    print(json.dumps(plan, indent=1)) if args.json else print_plan(plan)
    return 0


def cmd_config_show(args) -> int:
    from kiln.config import load_config
    from kiln.config_doc import show

    print(show(load_config(args.config, args.overrides)))
    return 0


def cmd_report(args) -> int:
    from kiln.ops.report import write_report

    print(write_report(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def cmd_export(args) -> int:
    from kiln.ops.export import export_hf

    print(json.dumps(export_hf(_checkpoint(args.checkpoint), Path(args.out_dir))))
    return 0


def cmd_import(args) -> int:
    from kiln.config import load_config
    from kiln.ops.export import import_hf

    cfg = load_config(args.config, args.overrides)
    print(json.dumps({"checkpoint": str(import_hf(Path(args.hf), cfg))}))
    return 0


CHECKPOINT_HELP = "a checkpoint folder, or a run folder or out_dir (its newest valid checkpoint, named on stderr)"
OVERRIDES_HELP = ("config overrides, e.g. train.lr=3e-4 (or --set KEY=VALUE, or every word after --); "
                  "`kiln config show CONFIG` lists the keys")
# One example per command, shown at the end of its --help.
EXAMPLES = {
    "run": "kiln run examples/tiny.yaml train.max_steps=50",
    "data": "kiln data 'crawl/*.warc.gz' --out out/docs -- data.languages=[en]      "
            "(after --, every word is an override; before it, any path)",
    "tokenizer train": "kiln tokenizer train out/tiny/docs --out out/tok tokenizer.vocab_size=8192",
    "pack": "kiln pack out/tiny/docs --tokenizer out/tiny/tokenizer --out out/shards pack.seq_len=512",
    "train": "torchrun --nproc_per_node=2 -m kiln train examples/tiny.yaml train.max_steps=500",
    "eval": "kiln eval out/tiny/run --mc tasks.jsonl      (a run folder: its newest valid checkpoint)",
    "generate": 'kiln generate out/tiny/run --prompt "The Debian" --temperature 0',
    "ckpt verify": "kiln ckpt verify out/tiny/run/checkpoints/step-00000300",
    "ckpt list": "kiln ckpt list out/tiny/run",
    "shards verify": "kiln shards verify out/tiny/shards",
    "shards inspect": "kiln shards inspect out/tiny/shards --at 0",
    "doctor": "kiln doctor --config examples/tiny.yaml",
    "preflight": "kiln preflight examples/tiny.yaml",
    "plan": "kiln plan examples/gpu-1b.yaml plan.devices=8",
    "config show": "kiln config show examples/tiny.yaml train.lr=1e-3",
    "report": "kiln report out/tiny/run",
    "export": "kiln export --hf out/tiny/run out/tiny/hf",
    "import": "kiln import --hf path/to/llama --config my.yaml      (tokenizer.path: path/to/llama in my.yaml)",
}


def _has_default(action: argparse.Action) -> bool:
    return not any(action.default is v for v in (None, False, True, argparse.SUPPRESS)) and action.nargs != 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option with a default says it; the epilog (the example) keeps its layout."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and _has_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _add_examples(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                command = f"{prefix} {name}".strip()
                sub.formatter_class = _HelpFormatter
                for option in sub._actions:
                    if option.dest == "overrides" and option.help is None:
                        option.help = OVERRIDES_HELP
                    if option.help is None and option.option_strings and _has_default(option):
                        option.help = "default: %(default)s"
                if command in EXAMPLES:
                    sub.epilog = f"example:\n  {EXAMPLES[command]}"
                _add_examples(sub, command)


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

    s = sub.add_parser("data", help="WARC/JSONL/Parquet files -> cleaned, deduplicated documents; "
                       "`kiln data explain DOC_ID_OR_URL --out DIR` tells what happened to one")
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
    s.add_argument("--positive", nargs="+", metavar="PATH", help="`kiln data classifier train --positive PATHS "
                   "--negative PATHS --out MODEL`: good documents (docs folders, JSONL or text files)")
    s.add_argument("--negative", nargs="+", metavar="PATH", help="classifier train: the documents to score low")
    s.set_defaults(fn=cmd_data)

    tok = sub.add_parser("tokenizer", help="tokenizer commands").add_subparsers(
        dest="tok_command", required=True, metavar="ACTION"
    )
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
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("--text", metavar="FILE", help="a UTF-8 text file instead of the validation shards")
    s.add_argument("--mc", metavar="FILE.jsonl", help='multiple choice: rows {"context", "choices", "answer"}; '
                   'prints {"mc": {"acc", "acc_norm", "n"}} (lm-eval-harness definitions)')
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("generate", help="print the prompt and a sampled continuation from a checkpoint")
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("--prompt", required=True, metavar="TEXT")
    s.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    s.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy")
    s.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    s.add_argument("--seed", type=int, default=0, metavar="S")
    s.set_defaults(fn=cmd_generate)

    ck = sub.add_parser("ckpt", help="checkpoint commands").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    s = ck.add_parser("verify", help="exit 0 when every file matches the manifest, else 1 naming the file")
    s.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    s.set_defaults(fn=cmd_ckpt_verify)
    s = ck.add_parser("list", help="each checkpoint of a run and whether it is valid")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--public-key", help="also check signatures with this Ed25519 public key (PEM)")
    s.set_defaults(fn=cmd_ckpt_list)

    sh = sub.add_parser("shards", help="token shard commands").add_subparsers(
        dest="shards_command", required=True, metavar="ACTION"
    )
    s = sh.add_parser("verify", help="exit 0 when every shard matches the manifest, else 1 naming the file")
    s.add_argument("shards_dir", metavar="SHARDS_DIR")
    s.set_defaults(fn=cmd_shards_verify)
    s = sh.add_parser("inspect", help="decode one sequence and list the documents (url, source, offset) it came from")
    s.add_argument("shards_dir", metavar="SHARDS_DIR")
    s.add_argument("--at", type=int, required=True, metavar="SEQUENCE_INDEX")
    s.add_argument("--split", default="train", choices=["train", "val"])
    s.add_argument("--tokenizer", help="tokenizer folder or tokenizer.json (default: tokenizer/ beside SHARDS_DIR)")
    s.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s.set_defaults(fn=cmd_shards_inspect)

    s = sub.add_parser("doctor", help="environment fingerprint and checks; exit 1 when a check fails")
    s.add_argument("--json", action="store_true")
    s.add_argument("--config", help="the run's config: probes its shards, its dtype, and doctor.* thresholds")
    s.add_argument(
        "--out-dir",
        default=None,
        help="where the run will write (checked for free space); default: the config's out_dir, else .",
    )
    s.add_argument("--against", metavar="RUN_DIR", help="compare with the environment the run recorded (run/env.json)")
    s.add_argument("--allreduce", action="store_true",
                   help="under torchrun: probe all-reduce across every rank it started, across nodes too "
                        "(torchrun --nnodes=2 --nproc_per_node=G --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT "
                        "-m kiln doctor --allreduce, on each node)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("preflight", help="a few real training steps on a slice of the data; exit 1 when a signal fails")
    s.add_argument("config")
    s.add_argument("--json", action="store_true")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_preflight)

    s = sub.add_parser("plan", help="estimate compute (C = 6ND), time on plan.devices, cost and per-device memory "
                                    "for the parallel degrees, with the assumptions")
    s.add_argument("config")
    s.add_argument("--json", action="store_true")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_plan)

    cf = sub.add_parser("config", help="config commands").add_subparsers(dest="config_command", required=True,
                                                                         metavar="ACTION")
    s = cf.add_parser("show", help="the resolved config with each key's description and default ('*' marks a change)")
    s.add_argument("config", nargs="?", help="a YAML config; without one, the defaults")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_config_show)

    s = sub.add_parser("report", help="write a self-contained report.html with the run's plots")
    s.add_argument("run_dir", metavar="RUN_DIR", help="the run folder ({out_dir}/run)")
    s.add_argument("--out", metavar="FILE", help="default: RUN_DIR/report.html")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama folder")
    s.add_argument("--hf", action="store_true", required=True, help="the Hugging Face transformers layout")
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("import", help="write {out_dir}/run/checkpoints/step-00000000 from a Hugging Face Llama folder; "
                                       "`kiln train CONFIG` then starts from it")
    s.add_argument("--hf", required=True, metavar="HF_DIR")
    s.add_argument(
        "--config", required=True, help="the config to train with; its model section must match HF_DIR/config.json"
    )
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_import)
    _add_examples(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words, explicit = _explicit_overrides(list(sys.argv[1:] if argv is None else argv))
    # KEY=VALUE overrides may also come after the options (argparse alone would refuse them there).
    args, extra = parser.parse_known_args(words)
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
    args.explicit, args.set_overrides = explicit is not None, explicit or []
    if not hasattr(args, "inputs"):
        args.overrides = [*args.overrides, *args.set_overrides]
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
    except BrokenPipeError:  # `kiln shards inspect ... | head`: the reader left; what is left to print goes nowhere
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush raises nothing
        return 141  # what a tool that SIGPIPE ended returns
    except OSError as exc:
        from kiln.manifest import disk_full_message, is_disk_full

        if not is_disk_full(exc):
            raise
        print(f"kiln: error: {disk_full_message(Path('.'), exc)}", file=sys.stderr)
        return 2
