"""The `kiln` command: parse, validate, dispatch. Each command's parser and runner live in kiln/commands/ (one
module per area); the work lives in the stage modules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln import __version__
from kiln.commands import data, flow, ops, train
from kiln.errors import IntegrityError, KilnError

# The commands in the order `kiln --help` lists them: each adds its parser (kiln/commands/).
COMMANDS = (flow.add_run, data.add_data, data.add_tokenizer, data.add_pack, train.add_train, train.add_eval,
            train.add_generate, train.add_ckpt, data.add_shards, ops.add_doctor, ops.add_preflight, ops.add_plan,
            ops.add_config, ops.add_report, train.add_export, train.add_import)
OVERRIDES_HELP = ("config overrides, e.g. train.lr=3e-4 (or --set KEY=VALUE, or every word after --); "
                  "`kiln config show CONFIG` lists the keys")


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


def _has_default(action: argparse.Action) -> bool:
    return not any(action.default is v for v in (None, False, True, argparse.SUPPRESS)) and action.nargs != 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option with a default says it; the epilog (the example) keeps its layout."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and _has_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _finish_help(parser: argparse.ArgumentParser) -> None:
    """Every command's --help: the formatter, the overrides' help, every default said."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.formatter_class = _HelpFormatter
                for option in sub._actions:
                    if option.dest == "overrides" and option.help is None:
                        option.help = OVERRIDES_HELP
                    if option.help is None and option.option_strings and _has_default(option):
                        option.help = "default: %(default)s"
                _finish_help(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="From raw web crawls to a trained language model.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    _finish_help(p)
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
