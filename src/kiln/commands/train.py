"""`kiln train`, and what works on its checkpoints: `eval`, `generate`, `ckpt verify | list`, `export --hf`,
`import --hf`."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.commands.args import CHECKPOINT_HELP, checkpoint_arg, console, example
from kiln.errors import KilnError


def add_train(sub) -> None:
    s = sub.add_parser("train", help="train (also under torchrun --nproc_per_node=N -m kiln train CONFIG)",
                       epilog=example("torchrun --nproc_per_node=2 -m kiln train examples/tiny.yaml "
                                      "train.max_steps=500"))
    s.add_argument("config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_train)


def cmd_train(args) -> int:
    from kiln.config import load_config
    from kiln.train.parallel import init_distributed, shutdown
    from kiln.train.remote_run import localize
    from kiln.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)  # validated before any process group forms
    cfg = localize(cfg)  # out_dir: s3://...: the local run folder, its tokenizer downloaded (remote_run.py)
    d = init_distributed(cfg.parallel.startup_timeout_s, cfg.layout.run)
    try:
        summary = Trainer(cfg, d, log=console().print if d.is_main else (lambda *_: None)).run()
        if d.is_main:
            print(json.dumps(summary))
    finally:
        shutdown()
    return 0


def add_eval(sub) -> None:
    s = sub.add_parser("eval", help='print {"loss", "perplexity", "tokens"} of a checkpoint',
                       epilog=example("kiln eval out/tiny/run --mc tasks.jsonl      "
                                      "(a run folder: its newest valid checkpoint)"))
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("--text", metavar="FILE", help="a UTF-8 text file instead of the validation shards")
    s.add_argument("--mc", metavar="FILE.jsonl", help='multiple choice: rows {"context", "choices", "answer"}; '
                   'prints {"mc": {"acc", "acc_norm", "acc_bytes", "n"}} (lm-eval-harness 0.4 definitions)')
    s.set_defaults(fn=cmd_eval)


def cmd_eval(args) -> int:
    from kiln.eval import evaluate_checkpoint

    if args.mc:
        from kiln.scoring.mc import load_questions
        from kiln.eval.mc import evaluate_mc_checkpoint

        load_questions(args.mc)  # a bad task file is named before the checkpoint is looked for
        print(json.dumps({"mc": evaluate_mc_checkpoint(checkpoint_arg(args.checkpoint), Path(args.mc))}))
        return 0
    print(json.dumps(evaluate_checkpoint(checkpoint_arg(args.checkpoint), Path(args.text) if args.text else None)))
    return 0


def add_generate(sub) -> None:
    s = sub.add_parser("generate", help="print the prompt and a sampled continuation from a checkpoint",
                       epilog=example('kiln generate out/tiny/run --prompt "The Debian" --temperature 0'))
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("--prompt", required=True, metavar="TEXT")
    s.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    s.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy")
    s.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    s.add_argument("--seed", type=int, default=0, metavar="S")
    s.set_defaults(fn=cmd_generate)


def cmd_generate(args) -> int:
    from kiln.eval.generate import generate_from_checkpoint

    out = generate_from_checkpoint(checkpoint_arg(args.checkpoint), args.prompt, args.max_new_tokens,
                                   args.temperature, args.top_k, args.seed)
    print(out.prompt + out.text)
    return 0


def add_ckpt(sub) -> None:
    ck = sub.add_parser("ckpt", help="checkpoint commands").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    s = ck.add_parser("verify", help="exit 0 when every file matches the manifest, else 1 naming the file",
                      epilog=example("kiln ckpt verify out/tiny/run/checkpoints/step-00000300"))
    s.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint folder, or a checkpoint.dir URL's "
                   "step-NNNNNNNN (credentials and endpoint from the environment: AWS_ENDPOINT_URL, ...)")
    s.set_defaults(fn=cmd_ckpt_verify)
    s = ck.add_parser("list", help="each checkpoint of a run and whether it is valid",
                      epilog=example("kiln ckpt list out/tiny/run"))
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, its checkpoints/, or a checkpoint.dir URL")
    s.add_argument("--public-key", help="also check signatures with this Ed25519 public key (PEM)")
    s.set_defaults(fn=cmd_ckpt_list)


def cmd_ckpt_verify(args) -> int:
    from kiln.checkpoint import verify_checkpoint
    from kiln.storage import is_url
    from kiln.checkpoint.remote import verify_url

    m = verify_url(args.checkpoint) if is_url(args.checkpoint) else verify_checkpoint(Path(args.checkpoint))
    print(f"ok: {args.checkpoint} (step {m['step']}, {len(m['files'])} files match manifest.json)")
    return 0


def cmd_ckpt_list(args) -> int:
    from kiln.checkpoint import checkpoint_table
    from kiln.run_layout import checkpoints_of
    from kiln.storage import is_url
    from kiln.checkpoint.remote import url_table

    run = Path(args.run_dir)
    root = checkpoints_of(run) if checkpoints_of(run).is_dir() else run
    rows = url_table(args.run_dir, args.public_key) if is_url(args.run_dir) else checkpoint_table(root, args.public_key)
    root = args.run_dir if is_url(args.run_dir) else root
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


def add_export(sub) -> None:
    s = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama folder",
                       epilog=example("kiln export --hf out/tiny/run out/tiny/hf"))
    s.add_argument("--hf", action="store_true", required=True, help="the Hugging Face transformers layout")
    s.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="the largest weight file (default 5GB, as transformers); more weights are split into "
                        "model-0000K-of-0000N.safetensors with model.safetensors.index.json")
    s.set_defaults(fn=cmd_export)


def cmd_export(args) -> int:
    from kiln.ops.export import export_hf, parse_size

    size = parse_size(args.max_shard_size)  # before the checkpoint is looked for
    print(json.dumps(export_hf(checkpoint_arg(args.checkpoint), Path(args.out_dir), size)))
    return 0


def add_import(sub) -> None:
    s = sub.add_parser("import", help="write {out_dir}/run/checkpoints/step-00000000 from a Hugging Face Llama folder; "
                                       "`kiln train CONFIG` then starts from it",
                       epilog=example("kiln import --hf path/to/llama --config my.yaml      "
                                      "(tokenizer.path: path/to/llama in my.yaml)"))
    s.add_argument("--hf", required=True, metavar="HF_DIR")
    s.add_argument(
        "--config", required=True, help="the config to train with; its model section must match HF_DIR/config.json"
    )
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_import)


def cmd_import(args) -> int:
    from kiln.config import load_config
    from kiln.ops.export import import_hf

    cfg = load_config(args.config, args.overrides)
    print(json.dumps({"checkpoint": str(import_hf(Path(args.hf), cfg))}))
    return 0
