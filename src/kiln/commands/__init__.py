"""The `kiln` commands, one module per area: each command's parser (`add_NAME(sub)`) beside the function that runs
it (`cmd_NAME(args)`), which imports its stage when it runs, so `kiln --help` loads no torch. cli.py lists the
adders in the order `kiln --help` shows them; a new command is an adder and a runner here, and one line there.
  args.py   what several commands share: KEY=VALUE words, the console, a checkpoint argument, examples
  flow.py   run
  data.py   data (explain, classifier train), tokenizer train, pack, shards verify / inspect
  train.py  train, eval, generate, ckpt verify / list, export, import
  ops.py    doctor, preflight, plan, config show, report
"""
