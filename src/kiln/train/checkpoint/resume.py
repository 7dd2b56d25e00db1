"""What a run checks before it trains: the prepared data exists, one writer holds the run folder, and a
checkpoint resumes only onto the data and tokenizer it was trained on.

- `require_prepared(cfg)`: the tokenizer and shards are there, else one line saying how to make them.
- `lock_run(run_dir, d)`: rank 0 takes the run folder's lock (`kiln.lock`) for the whole job; every
  rank learns whether it got it, so a refused job stops on all ranks at once.
- `data_fingerprint(train)`: what the loader position of a checkpoint refers to (the shards manifests
  and source weights).
- `check_resume_data(...)`: the checkpoint's recorded data fingerprint and tokenizer sha256 must match
  the shards it resumes onto; otherwise a refusal that says which changed and what to do, unless
  `train.resume_on_new_data=true`, which resumes the weights with the loader at a clean position.
- `check_settings(...)`: a checkpoint resumes only under its own model/pack/tokenizer settings and seed; a
  change is refused naming each key, the checkpoint's value and the config's.
- `check_vocab_size(...)`: a checkpoint's embeddings fit only its own vocabulary size (no override).
- `resume_notes(...)`: lines a resumed run owes the user (batch size changed, schedule settings changed,
  max_steps already passed).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from kiln.errors import KilnError
from kiln.manifest import sha256_file
from kiln.checkpoint.folder import listed_file


def require_prepared(cfg) -> None:
    """The tokenizer and (unless loader.sources names others) the shards must exist before training."""
    tok = cfg.layout.tokenizer / "tokenizer.json"
    shards = cfg.layout.shards / "manifest.json"
    missing = [p for p in ([tok] + ([] if cfg.loader.sources else [shards])) if not p.is_file()]
    if missing:
        raise KilnError(f"{' and '.join(str(p) for p in missing)} missing: training needs the tokenizer and shards; "
                        f"make them first with `kiln run CONFIG --until pack` (out_dir={cfg.out_dir})")


def lock_run(run_dir: Path, d) -> Any:
    """Rank 0 locks `run_dir` for the job (returns the lock; None on other ranks). A refusal on rank 0
    stops every rank: rank 0 raises the lock's message, the others a line pointing at it."""
    from kiln.lock import OutputLock
    from kiln.train.parallel import all_reduce_sum

    lock, error = None, None
    if d.is_main:
        try:
            lock = OutputLock(run_dir, "`kiln train`").acquire()
        except KilnError as exc:
            error = exc
    failed, = all_reduce_sum([float(error is not None)], d)
    if error is not None:
        raise error
    if failed:
        raise KilnError(f"{run_dir}: rank 0 could not lock the run folder (its message says who holds it)")
    return lock


def data_fingerprint(train) -> str:
    """sha256 of the shards manifest for one local source (as checkpoints have always recorded it);
    for several or remote sources, of each source's location, weight and manifest."""
    sets = train.sets
    if len(sets) == 1 and not train.weights and hasattr(sets[0].source, "folder"):
        return sha256_file(Path(sets[0].source.folder) / "manifest.json")
    weights = list(train.weights) if train.weights else [None] * len(sets)
    parts = [[s.location, w, hashlib.sha256(json.dumps(s.manifest, sort_keys=True).encode()).hexdigest()]
             for s, w in zip(sets, weights)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def check_resume_data(manifest: dict[str, Any], folder: Path, fingerprint: str, tokenizer_sha: str,
                      allow_new_data: bool, log: Callable[[str], None],
                      tokenizer_file: Path | None = None) -> list[str]:
    """What changed since checkpoint `folder` (its manifest.json) was written: [] when nothing did.

    A change is refused unless `allow_new_data`; then it is logged and returned, and the caller
    starts the loader at a clean position (the old position means nothing on other shards). A tokenizer
    (`tokenizer_file`, this run's) of another vocabulary size is refused either way, as `check_vocab_size`
    would refuse the weights: no override is suggested that then fails.
    """
    saved_data = manifest.get("data_fingerprint")
    saved_tok = manifest.get("tokenizer_sha256") or manifest.get("files", {}).get("tokenizer.json", {}).get("sha256")
    changed = []
    if saved_data and saved_data != fingerprint:
        changed.append(f"the shards changed (data fingerprint {saved_data[:12]}… -> {fingerprint[:12]}…)")
    if saved_tok and saved_tok != tokenizer_sha:
        changed.append(f"the tokenizer changed (sha256 {saved_tok[:12]}… -> {tokenizer_sha[:12]}…)")
    if not changed:
        return []
    if saved_tok and saved_tok != tokenizer_sha and tokenizer_file is not None:
        saved_vocab, vocab = _vocab_size(listed_file(folder, "tokenizer.json")), _vocab_size(tokenizer_file)
        if saved_vocab is not None and saved_vocab != vocab:
            raise KilnError(_other_vocabulary(folder, saved_vocab, vocab))
    what = " and ".join(changed)
    if not allow_new_data:
        raise KilnError(f"{folder} was trained on other data: {what}. To start fresh, use a new out_dir or move "
                        f"{folder.parent} away; to continue these weights on the new data deliberately, set "
                        f"train.resume_on_new_data=true (the loader then starts at epoch 0, position 0)")
    log(f"warning: resuming {folder} on new data ({what}); train.resume_on_new_data=true: "
        f"the loader starts at epoch 0, position 0")
    return changed


def check_vocab_size(weights: dict[str, Any], vocab_size: int, folder: Path) -> None:
    """The checkpoint's embedding rows must be the shards' vocabulary size: no override carries weights across."""
    saved = next((int(t.shape[0]) for name, t in weights.items() if name.endswith("tok_embeddings.weight")), None)
    if saved is not None and saved != vocab_size:
        raise KilnError(_other_vocabulary(folder, saved, vocab_size))


def _other_vocabulary(folder: Path, saved: int, vocab_size: int) -> str:
    return (f"{folder} was trained with a vocabulary of {saved} tokens, the shards' tokenizer has {vocab_size}: its "
            f"weights cannot continue on it (not even with train.resume_on_new_data); start a fresh run (a new "
            f"out_dir, or move {Path(folder).parent.parent} away) or keep the old tokenizer and repack with it")


def _vocab_size(file: Path) -> int | None:
    """The vocabulary size of a tokenizer.json (None when there is none to read: the weights' check decides)."""
    from kiln.tokenizer import load_tokenizer

    try:
        return load_tokenizer(file).get_vocab_size()
    except KilnError:
        return None


def saved_config(folder: Path) -> dict[str, Any]:
    """A checkpoint's config.yaml (a file its manifest lists: `listed_file`) as a dict; {} when it cannot be read
    (the checks that name keys then say less)."""
    try:
        saved = yaml.safe_load(listed_file(folder, "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def differences(saved: dict[str, Any], now: dict[str, Any], keys: Iterable[str], prefix: str = "") -> list[str]:
    """`PREFIXkey.sub: A in the checkpoint, B in the config` for each setting under `keys` (nested sections by
    dotted key) whose value differs between the checkpoint's config and this one."""
    def flat(d: Any, at: str) -> dict[str, Any]:
        if not isinstance(d, dict) or not d:
            return {at: d}
        return {k: v for key, value in d.items() for k, v in flat(value, f"{at}.{key}").items()}

    a = {k: v for key in keys if key in saved for k, v in flat(saved[key], prefix + key).items()}
    b = {k: v for key in keys if key in now for k, v in flat(now[key], prefix + key).items()}
    absent = "(not set)"
    return [f"{k}: {a.get(k, absent)} in the checkpoint, {b.get(k, absent)} in the config"
            for k in sorted(a.keys() | b.keys()) if a.get(k, absent) != b.get(k, absent)]


def check_settings(saved_hash: str | None, config_hash: str, folder: Path, config_yaml: str,
                   sections: tuple[str, ...]) -> None:
    """A checkpoint resumes only under the settings it was trained with (`sections` and the seed, as hashed in
    its manifest and state): other ones are refused in one line naming each key that differs (at most 6)."""
    if saved_hash == config_hash:
        return
    saved = saved_config(folder)
    diff = differences(saved, yaml.safe_load(config_yaml) or {}, (*sections, "seed")) if saved else []
    what = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "") if diff else \
        f"its {', '.join(sections)} settings or seed differ from this config's"
    raise KilnError(f"{folder} was trained with other settings ({what}): a checkpoint resumes only under its own "
                    f"{', '.join(f'{s}.*' for s in sections)} and seed (not even with train.resume_on_new_data); "
                    f"set them back to resume it, or start a new run (a new out_dir, or move {Path(folder).parent} "
                    f"away)")


def resume_notes(folder: Path, train, step: int) -> list[str]:
    """Lines a resumed run owes: a changed train.batch_size, changed schedule settings, and a max_steps below the
    checkpoint's step."""
    notes = []
    saved = saved_config(folder).get("train")
    old_batch = saved.get("batch_size") if isinstance(saved, dict) else None
    if old_batch is not None and old_batch != train.batch_size:
        notes.append(f"warning: {folder.name} was trained with train.batch_size={old_batch}, this run uses "
                     f"{train.batch_size}: the sample order goes on from the same position, but each step now "
                     f"takes {train.batch_size} sequences, so the run is no longer the same as an "
                     f"uninterrupted one")
    if note := schedule_note(folder, train, step):
        notes.append(note)
    if step > train.max_steps:
        notes.append(f"{folder.name} is at step {step}, beyond train.max_steps={train.max_steps}: nothing to "
                     f"train; raise train.max_steps above {step} to continue")
    return notes


# The train.* settings a resume takes from this config, not the checkpoint: the lr schedule, the clipping and
# AdamW's settings (optimizer_state.settings_kept; the checkpoint gives the moments).
SCHEDULE_KEYS = ("lr", "min_lr_ratio", "warmup_steps", "max_steps", "schedule", "decay_fraction", "decay_shape",
                 "breathing", "base_lr", "reference_batch_size", "warmup_calibration", "grad_clip", "grad_clip_groups",
                 "weight_decay", "beta1", "beta2")


def schedule_note(folder: Path, train, step: int) -> str | None:
    """One line naming the schedule settings (SCHEDULE_KEYS) that changed since checkpoint `folder`: this run
    applies its own from `step` on, which nothing else would say."""
    saved = saved_config(folder).get("train")
    if not isinstance(saved, dict):
        return None
    diff = differences(saved, train.model_dump(mode="json"), SCHEDULE_KEYS, prefix="train.")
    if not diff:
        return None
    return (f"note: resuming {Path(folder).name} with other schedule or optimizer settings, applied from step "
            f"{step + 1} on: {'; '.join(diff)}")
