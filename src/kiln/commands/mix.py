"""`kiln mix`: choose the data mixture by the model: a swarm of proxy runs, a fit, a proposal, its proof
(kiln.mix)."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.commands.args import console, example
from kiln.errors import KilnError

EXAMPLE = example("""kiln mix mix.yaml      (then: kiln mix report out/mix)

a mix file (paths relative to it):
  base: tiny.yaml                 # the Kiln config every run starts from
  out_dir: ../out/mix
  sources:                        # each through the data stage and packed apart; one tokenizer for all
    docs: {inputs: [python-docs.warc.gz]}
    web: {inputs: [crawl/*.warc.gz], set: {data.quality.fineweb.enabled: false}}
  proxy: cpu-tiny                 # cpu-tiny | 20m | 150m | 400m | 1b (null: the base config's model)
  proxy_tokens: 400000
  swarm: 24                       # proxy runs on sampled mixtures (default: 4 per source)
  concentration: 1.0              # the Dirichlet around the natural shares (larger: closer to them)
  max_epochs: 4                   # no source repeats more often than this in any run
  seeds: [1, 2, 3]                # the verification: natural, proposed and best-swarm on each seed
  eval:
    text: {python: eval/python.jsonl}
    tasks: [{name: mc, path: eval/mc.jsonl}]
  target: {python: 1.0}           # minimise a weighted mean of bits per byte (or {mc/acc: 1}: maximise)""")


def add_mix(sub) -> None:
    s = sub.add_parser("mix", help="choose the data mixture by the model: proxy runs on sampled mixtures, a fit, "
                       "the proposed weights, and an ablation that proves them: mix.json and mix.html; "
                       "`kiln mix report DIR` fits and compares what has finished", epilog=EXAMPLE)
    s.add_argument("file", nargs="+", metavar="MIX.yaml", help="the mix file (or: report DIR)")
    s.add_argument("--only", metavar="NAME[,NAME]", help="train and measure only these swarm runs (run-000, ...) "
                   "or verification arms (natural, proposed, best-swarm): one job each; the sources come first")
    s.add_argument("--plan", action="store_true", help="print what the swarm and the verification would cost at "
                   "each proxy scale, here (measured) and on GPUs (kiln plan), and stop")
    s.add_argument("--gpus", type=int, default=8, metavar="N", help="--plan: GPUs to plan for")
    s.add_argument("--gpu", default="H100", metavar="NAME", help="--plan: the GPU (a name kiln plan knows)")
    s.set_defaults(fn=cmd_mix)


def cmd_mix(args) -> int:
    """`kiln mix FILE [--only NAMES] [--plan]`, or `kiln mix report DIR`."""
    from kiln import mix

    out = console()
    log = lambda text: out.print(text, markup=False)  # noqa: E731  (source names and paths are the user's)
    words = args.file
    if words[0] == "report" and len(words) == 2:
        data = mix.report_finished(words[1], log)
    elif len(words) != 1:
        raise KilnError("kiln mix: give one mix file (kiln mix MIX.yaml), or `kiln mix report DIR`")
    elif args.plan:
        from kiln.mix.driver import print_plan

        print_plan(words[0], args.gpus, args.gpu)
        return 0
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise KilnError("kiln mix runs as one process; to train runs on several GPUs: `kiln mix FILE --only "
                            "run-000` per swarm run (or `torchrun ... -m kiln train OUT/swarm/run-NNN/config.yaml`), "
                            "then `kiln mix FILE` fits, proposes and verifies")
        only = [a for a in (args.only or "").split(",") if a] or None
        data = mix.mix(words[0], log, only=only)
    if data is not None:
        from kiln.mix.report import print_summary

        print_summary(data, out)
        print(Path(data["out_dir"]) / "mix.json")
    return 0
