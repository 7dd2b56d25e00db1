"""The `kiln` command: parse, validate, dispatch. Each command's parser and runner live in kiln/commands/ (one
module per area); the work lives in the stage modules."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kiln import __version__
from kiln.commands import ablate, data, flow, mix, ops, train
from kiln.errors import IntegrityError, KilnError

# The commands in the order `kiln --help` lists them: each adds its parser (kiln/commands/).
COMMANDS = (flow.add_run, data.add_data, data.add_tokenizer, data.add_pack, train.add_train, train.add_eval,
            train.add_generate, train.add_ckpt, data.add_shards, ops.add_doctor, ops.add_preflight, ops.add_plan,
            ops.add_config, ops.add_report, train.add_export, train.add_import, ablate.add_ablate,
            mix.add_mix)
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
    if (refused := _refused_overrides(args, [*extra, *(explicit or [])])) is not None:
        print(f"kiln: error: {refused}", file=sys.stderr)
        return 2
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
    except ModuleNotFoundError as exc:  # an optional extra that is not installed (kiln.install)
        from kiln.install import missing_module_message

        if (message := missing_module_message(exc)) is None:
            raise
        print(f"kiln: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kiln shards inspect ... | head`: the reader left; what is left to print goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush raises nothing
        return 141  # what a tool that SIGPIPE ended returns
    except Exception as exc:  # the last resort: whatever no part turned into a KilnError (a bug, or a library's)
        from kiln.manifest import disk_full_message, is_disk_full

        if is_disk_full(exc):
            print(f"kiln: error: {disk_full_message(_output_folder(args) or Path('.'), exc)}", file=sys.stderr)
            return 2
        if os.environ.get("KILN_DEBUG"):
            raise
        try:
            line = _unexpected(exc, args)
        except Exception as inner:  # the last resort itself never fails: the one line, without its log
            line = (f"kiln: error: unexpected {type(exc).__name__} (the traceback could not be written: "
                    f"{type(inner).__name__}); run with KILN_DEBUG=1 for the traceback")
        print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)
        return 3


def _refused_overrides(args: argparse.Namespace, overrides: list[str]) -> str | None:
    """KEY=VALUE words given to a command that reads no config (eval, generate, ckpt, shards, ablate, ...): refused,
    never silently ignored."""
    if not overrides or hasattr(args, "inputs") or hasattr(args, "overrides"):
        return None
    name = " ".join([args.command, *(v for k, v in vars(args).items() if k.endswith("_command"))])
    fix = ("put them in the ablation file (an arm's set:, or its base config)" if name == "ablate" else
           "put them in the mix file (a source's set:, or its base config)" if name == "mix" else
           f"its settings are its options (kiln {name} --help)")
    return f"`kiln {name}` takes no KEY=VALUE overrides, got {' '.join(overrides)}; {fix}"


def _output_folder(args: argparse.Namespace) -> Path | None:
    """Where the command writes: the config's out_dir (run, train, import), else the folder its --out (or
    OUT_DIR) is made in; None for a command that only reads."""
    if getattr(args, "config", None) and args.command in ("run", "train", "import", "preflight"):
        from kiln.config import load_config

        try:
            return load_config(args.config, args.overrides).out
        except Exception:  # the config is what failed: the log goes to the next place (the user sees it named)
            return None
    out = getattr(args, "out", None) or getattr(args, "out_dir", None)
    return Path(out).absolute().parent if out else None


def _unexpected(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for a failure Kiln has no message for, its traceback written to a log file in the output folder
    (or the temporary folder when there is none, or it cannot be written)."""
    import tempfile
    import time
    import traceback

    name = f"kiln-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    text = "".join(traceback.format_exception(exc))
    log = None
    for folder in (_output_folder(args), Path(tempfile.gettempdir())):
        if folder is None:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # argv and messages may hold what is not UTF-8 (bytes the shell passed): written escaped, never refused
            (folder / name).write_text(f"kiln {' '.join(sys.argv[1:])}\n{text}", "utf-8", "backslashreplace")
            log = folder / name
            break
        except OSError:
            continue
    what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    where = f"the traceback is in {log}" if log else "the traceback could not be written"
    return f"kiln: error: unexpected {what} ({where}); run with KILN_DEBUG=1 for the traceback"
