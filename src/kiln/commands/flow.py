"""`kiln run`: every stage of kiln.stages in order (kiln.flow)."""

from __future__ import annotations

import shlex

from kiln.run_layout import STAGE_FOLDERS
from kiln.commands.args import console, example


def add_run(sub) -> None:
    s = sub.add_parser("run", help="every stage; re-running skips finished stages and resumes training",
                       epilog=example("kiln run examples/tiny.yaml train.max_steps=50"))
    s.add_argument("config")
    s.add_argument("--until", choices=list(STAGE_FOLDERS), default="train",
                   help="stop after this stage (e.g. prepare shards here, then train under torchrun)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_run)


def cmd_run(args) -> int:
    from kiln.config import load_config
    from kiln.flow import run_all
    from kiln.summary import print_summary

    cfg = load_config(args.config, args.overrides)
    out = console()
    result = run_all(cfg, log=out.print, until=args.until)
    from kiln.terminal import console as plain_console

    config = shlex.join([args.config, *(o for o in args.overrides if not o.startswith("train.max_steps="))])
    same = shlex.join([args.config, *args.overrides])  # every stage, as typed: resumes a stopped run
    print_summary(result, plain_console(width=max(out.width, 110)), config=config, again=same)
    return 0
