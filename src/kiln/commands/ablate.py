"""`kiln ablate`: train proxy models on data recipes and say which is better (kiln.ablate)."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.run_layout import STAGE_FOLDERS
from kiln.commands.args import console, example
from kiln.errors import KilnError

EXAMPLE = example("""kiln ablate examples/ablation.yaml      (then: kiln ablate report out/ablation)

an ablation file (paths relative to it):
  base: tiny.yaml                 # the Kiln config every arm starts from
  out_dir: ../out/ablation
  seeds: [1, 2, 3]                # each arm is trained once per seed
  baseline: default               # every other arm is compared with it
  proxy: cpu-tiny                 # cpu-tiny | 20m | 150m | 400m | 1b (null: the base config's model)
  arms:
    - {name: default, set: {}}    # dotted overrides of the base config
    - {name: no-fineweb, set: {data.quality.fineweb.enabled: false}}
    - {name: default-again, set: {}, seeds: [4, 5, 6]}   # an A/A check
  eval:
    text: {reference: eval/reference.jsonl}       # bits per byte on each named set
    tasks: [{name: mini-mc, path: eval/mc.jsonl}]  # kiln eval --mc's format""")


def add_ablate(sub) -> None:
    s = sub.add_parser("ablate", help="train proxy models on data recipes (arms) and say, with confidence, which is "
                       "better: ablation.json and ablation.html; `kiln ablate report DIR` compares what has finished",
                       epilog=EXAMPLE)
    s.add_argument("file", nargs="+", metavar="ABLATION.yaml", help="the ablation file (or: report DIR)")
    s.add_argument("--only", metavar="ARM[,ARM]", help="pack, train and measure only these arms (one job per arm); "
                   "every arm's data and the shared tokenizer come first")
    s.add_argument("--until", choices=list(STAGE_FOLDERS), default="train",
                   help="stop after this step (tokenizer: also the eval-overlap check; pack: every run ready for "
                        "`kiln train ARM/seed-N/config.yaml`)")
    s.add_argument("--plan", action="store_true", help="print what each proxy scale would cost, here (measured) "
                   "and on GPUs (kiln plan), and stop")
    s.add_argument("--gpus", type=int, default=8, metavar="N", help="--plan: GPUs to plan for")
    s.add_argument("--gpu", default="H100", metavar="NAME", help="--plan: the GPU (a name kiln plan knows)")
    s.set_defaults(fn=cmd_ablate)


def cmd_ablate(args) -> int:
    """`kiln ablate FILE [--only ARMS] [--until STEP] [--plan]`, or `kiln ablate report DIR`."""
    from kiln import ablate

    out = console()
    log = lambda text: out.print(text, markup=False)  # noqa: E731  (arm names and paths are the user's)
    words = args.file
    if words[0] == "report" and len(words) == 2:
        data = ablate.report_finished(words[1], log)
    elif len(words) != 1:
        raise KilnError("kiln ablate: give one ablation file (kiln ablate ABLATION.yaml), or `kiln ablate report DIR`")
    elif args.plan:
        from kiln.ablate.estimate import print_estimates

        print_estimates(words[0], args.gpus, args.gpu)
        return 0
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise KilnError("kiln ablate runs as one process; to train runs on several GPUs: `kiln ablate FILE "
                            "--until pack`, then `torchrun ... -m kiln train OUT/ARM/seed-N/config.yaml` for each "
                            "run (one job each), then `kiln ablate FILE` measures and compares them")
        only = [a for a in (args.only or "").split(",") if a] or None
        data = ablate.ablate(words[0], log, until=args.until, only=only)
    if data is not None:
        from kiln.ablate.report import print_verdicts

        print_verdicts(data, out)
        print(Path(data["out_dir"]) / "ablation.json")
    return 0
