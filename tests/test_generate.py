"""Sampling from a tiny trained checkpoint: greedy is the step-by-step argmax, seeds reproduce, top-k=1 is
greedy, EOS stops, the context is cropped to the model's window, and `kiln generate` prints the text."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln.scoring.sampling import generate, sample_ids
from kiln.eval.generate import generate_from_checkpoint
from kiln.tokenizer import eos_id, load_tokenizer
from kiln.checkpoint import checkpoint_config, list_checkpoints, load_checkpoint
from kiln.model.build import build_model
from kiln.train.trainer import Trainer

PROMPT = "The Debian"


@pytest.fixture(scope="module")
def checkpoint(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 10, "eval_every": 0}), log=lambda *_: None).run()
    return list_checkpoints(out / "run" / "checkpoints")[-1]


@pytest.fixture(scope="module")
def loaded(checkpoint):
    tok = load_tokenizer(checkpoint / "tokenizer.json")
    cfg = checkpoint_config(checkpoint)
    model = build_model(cfg.model, tok.get_vocab_size(), cfg.pack.seq_len)
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    return model.eval(), tok


def argmax_continuation(model, ids: list[int], n: int) -> list[int]:
    """The reference: feed the (cropped) sequence, take the argmax, append, n times."""
    ids = list(ids)
    window = model.max_seq_len
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[-window:]]))[0, -1].argmax()))
    return ids[len(ids) - n:]


def test_greedy_is_the_argmax_step_by_step_and_deterministic(loaded):
    model, tok = loaded
    context = [eos_id(tok)] + tok.encode(PROMPT, add_special_tokens=False).ids
    expected = argmax_continuation(model, context, 12)
    ids, stop = sample_ids(model, context, 12, temperature=0, seed=1)  # no eos given: never stops early
    assert ids == expected and stop == "max_new_tokens"
    assert sample_ids(model, context, 12, temperature=0, seed=99)[0] == expected  # the seed plays no part


def test_same_seed_same_text_and_seeds_differ(loaded):
    model, tok = loaded
    runs = {s: generate(model, tok, PROMPT, 30, temperature=1.0, seed=s) for s in (1, 2, 3)}
    again = generate(model, tok, PROMPT, 30, temperature=1.0, seed=1)
    assert again.token_ids == runs[1].token_ids and again.text == runs[1].text
    assert len({tuple(r.token_ids) for r in runs.values()}) > 1
    assert runs[1].text == tok.decode(runs[1].token_ids, skip_special_tokens=False)


def test_top_k_1_equals_greedy(loaded):
    model, tok = loaded
    greedy = generate(model, tok, PROMPT, 15, temperature=0)
    for seed in (0, 5):
        assert generate(model, tok, PROMPT, 15, temperature=1.3, top_k=1, seed=seed).token_ids == greedy.token_ids


def test_top_k_only_samples_among_the_k_likeliest(loaded):
    model, tok = loaded
    context = [eos_id(tok)] + tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        top3 = set(model(torch.tensor([context]))[0, -1].topk(3).indices.tolist())
    firsts = {sample_ids(model, context, 1, temperature=5.0, top_k=3, seed=s)[0][0] for s in range(40)}
    assert firsts <= top3 and len(firsts) > 1  # a high temperature spreads over all three, never beyond


def test_stops_at_eos_without_emitting_it(loaded):
    model, tok = loaded
    context = [eos_id(tok)] + tok.encode(PROMPT, add_special_tokens=False).ids
    free = argmax_continuation(model, context, 8)
    stop_token = free[4]
    first = free.index(stop_token)  # the greedy path may reach that token earlier
    ids, stop = sample_ids(model, context, 8, temperature=0, eos=stop_token)
    assert ids == free[:first] and stop == "eos"


def test_context_is_cropped_to_the_model_window(loaded):
    model, tok = loaded
    long_prompt = " ".join(["Debian reference manual chapter"] * 40)
    context = [eos_id(tok)] + tok.encode(long_prompt, add_special_tokens=False).ids
    assert len(context) > model.max_seq_len
    ids, _ = sample_ids(model, context, 5, temperature=0)
    assert ids == argmax_continuation(model, context, 5)


def test_generate_from_checkpoint_matches_the_loaded_model(checkpoint, loaded):
    model, tok = loaded
    direct = generate(model, tok, PROMPT, 10, temperature=0.8, top_k=20, seed=3)
    from_folder = generate_from_checkpoint(checkpoint, PROMPT, 10, temperature=0.8, top_k=20, seed=3)
    assert from_folder == direct


def test_cli_prints_prompt_and_continuation(checkpoint, loaded, capsys):
    model, tok = loaded
    expected = generate(model, tok, PROMPT, 10, temperature=0)
    capsys.readouterr()
    assert kiln(["generate", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "10", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == PROMPT + expected.text + "\n"
    assert (
        kiln(["generate", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "10", "--seed", "4", "--top-k", "5"])
        == 0
    )
    assert capsys.readouterr().out == PROMPT + generate(model, tok, PROMPT, 10, top_k=5, seed=4).text + "\n"


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "0"], "--top-k"),
    (["--max-new-tokens", "-2"], "--max-new-tokens"),
])
def test_cli_rejects_bad_sampling_settings(checkpoint, capsys, args, message):
    assert kiln(["generate", str(checkpoint), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and message in err


def test_cli_names_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    assert kiln(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_cli_refuses_a_prompt_that_is_not_utf8_in_one_line(checkpoint, capsys):
    """Issue 45 item 10: a prompt of bytes that are not UTF-8 (Python's argv holds them as lone surrogates) is one
    line naming --prompt and the byte, not a traceback from the encoder."""
    assert kiln(["generate", str(checkpoint), "--prompt", "caf\udce9 au lait", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["kiln: error: --prompt is not valid UTF-8 (byte 0xe9 at character 3); pass "
                                        "the prompt as UTF-8 text (e.g. convert it with iconv -t UTF-8)"]
