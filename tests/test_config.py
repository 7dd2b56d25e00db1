"""Configuration: YAML file + dotted KEY=VALUE overrides, validated before any work.

Covered here:
- examples/tiny.yaml loads with the values written in it; defaults fill the rest;
  to_yaml() round-trips through a file.
- overrides change values with YAML typing: ints, floats (3e-4 and 3.0e-4), bools,
  null (and an empty value), lists; later overrides win; malformed overrides are refused.
- a misspelt key, in a YAML file or in an override, raises a one-line ConfigError naming
  the key and the closest valid one (train.max_step -> train.max_steps, trian -> train).
- bad values (train.max_steps=-1, train.dtype=fp8, model.dim=100 model.n_heads=3) name the key.
- a missing file, invalid YAML and a non-mapping document give a ConfigError naming the file.
- the CLI turns a misspelt key into exit code 2 and one `kiln: error:` line on stderr,
  before any work (no output folder is created).
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main
from kiln.config import Config, TrainConfig, build_config, load_config, parse_overrides
from kiln.errors import ConfigError, KilnError

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "examples" / "tiny.yaml"

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def config_error(path, overrides=None) -> str:
    """The message of the ConfigError that load_config raises; it must be a single line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


# --- loading ---------------------------------------------------------------------------------

def test_tiny_yaml_loads_with_its_values():
    from kiln.config import resolve_paths

    cfg = load_config(TINY_YAML)
    raw = resolve_paths(
        yaml.safe_load(TINY_YAML.read_text()), TINY_YAML.resolve().parent
    )  # paths: relative to the file
    dumped, defaults = cfg.model_dump(), Config().model_dump()
    for name, value in dumped.items():
        if isinstance(value, dict):  # a section: keys in the file win, the others keep their defaults
            assert value == defaults[name] | raw.get(name, {}), name
        else:
            assert value == raw.get(name, defaults[name]), name
    assert cfg.data.inputs == [str(ROOT / "examples" / "data" / "sample.warc.gz")] and cfg.data.workers == 2
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.train.lr, cfg.train.dtype) == (4, 2, 3e-3, "fp32")
    assert cfg.out == Path(cfg.out_dir)


def test_no_path_gives_defaults_and_empty_file_too(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    assert load_config(None) == Config() == load_config(empty)
    assert load_config(None).train.max_steps == 100


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(TINY_YAML, ["train.lr=3e-4", "data.languages=[en, de]"])
    path = tmp_path / "dumped.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert again.section_hash("model", "train") == cfg.section_hash("model", "train")


def test_section_hash_follows_its_sections_only():
    base = load_config(TINY_YAML)
    assert load_config(TINY_YAML, ["train.max_steps=5"]).section_hash("model") == base.section_hash("model")
    assert load_config(TINY_YAML, ["model.dim=64"]).section_hash("model") != base.section_hash("model")
    assert load_config(TINY_YAML, ["seed=1"]).section_hash("model") != base.section_hash("model")


# --- overrides and YAML typing -----------------------------------------------------------------

def test_override_changes_one_value_and_keeps_the_rest():
    base = load_config(TINY_YAML)
    cfg = load_config(TINY_YAML, ["train.max_steps=5"])
    assert cfg.train.max_steps == 5 and type(cfg.train.max_steps) is int
    assert cfg.train.model_dump() == base.train.model_dump() | {"max_steps": 5}
    assert cfg.model == base.model and cfg.data == base.data


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("train.lr=3e-4", lambda c: c.train.lr, 3e-4),  # PyYAML reads 3e-4 as a string; still a float
        ("train.lr=3.0e-4", lambda c: c.train.lr, 3e-4),
        ("train.lr=1", lambda c: c.train.lr, 1.0),
        ("train.max_steps=0x10", lambda c: c.train.max_steps, 16),
        ("train.max_steps=1_000", lambda c: c.train.max_steps, 1000),
        ("train.max_steps='7'", lambda c: c.train.max_steps, 7),
        ("model.tie_embeddings=true", lambda c: c.model.tie_embeddings, True),
        ("model.tie_embeddings=yes", lambda c: c.model.tie_embeddings, True),
        ("model.tie_embeddings=false", lambda c: c.model.tie_embeddings, False),
        ("model.n_kv_heads=null", lambda c: c.model.n_kv_heads, None),
        ("model.n_kv_heads=~", lambda c: c.model.n_kv_heads, None),
        ("model.n_kv_heads=", lambda c: c.model.n_kv_heads, None),
        ("data.languages=[en, de, ja]", lambda c: c.data.languages, ["en", "de", "ja"]),
        ("data.languages=[]", lambda c: c.data.languages, []),
        # paths typed on the command line are relative to the working directory
        ("data.inputs=[a.warc.gz, 'b c.warc.gz']", lambda c: c.data.inputs,
         [str(Path.cwd() / "a.warc.gz"), str(Path.cwd() / "b c.warc.gz")]),
        ("out_dir=runs/x=1", lambda c: c.out_dir, str(Path.cwd() / "runs/x=1")),  # only the first '=' splits
        (" seed = 99 ", lambda c: c.seed, 99),
        ("train.dtype=bf16", lambda c: c.train.dtype, "bf16"),
    ],
)
def test_override_values_are_yaml_typed(override, get, expected):
    value = get(load_config(TINY_YAML, [override]))
    assert value == expected and type(value) is type(expected)


def test_parse_overrides_builds_nested_tree():
    tree = parse_overrides(
        ["train.lr=3.0e-4", "seed=1", "train.max_steps=5", "data.languages=[en]", "model.n_kv_heads=null"]
    )
    assert tree == {
        "train": {"lr": 3e-4, "max_steps": 5},
        "seed": 1,
        "data": {"languages": ["en"]},
        "model": {"n_kv_heads": None},
    }


def test_later_override_wins():
    assert load_config(TINY_YAML, ["train.max_steps=5", "train.max_steps=6"]).train.max_steps == 6


@pytest.mark.parametrize("pair", ["train.max_steps", "=5", "seed"])
def test_override_without_key_or_equals_is_refused(pair):
    msg = config_error(TINY_YAML, [pair])
    assert repr(pair) in msg and "KEY=VALUE" in msg


def test_override_below_a_value_is_refused():
    msg = config_error(TINY_YAML, ["train.lr=1", "train.lr.x=2"])
    assert "'train.lr.x=2'" in msg and "'lr' is a value" in msg


@FAST
@given(n=st.integers(min_value=1, max_value=10**12))
def test_any_positive_int_override_round_trips(n):
    assert load_config(None, [f"train.max_steps={n}"]).train.max_steps == n


@FAST
@given(
    x=st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False),
    style=st.sampled_from(["repr", "e", "g"]),
)
def test_any_positive_float_override_round_trips(x, style):
    text = {"repr": repr(x), "e": f"{x:.17e}", "g": f"{x:.17g}"}[style]
    assert load_config(None, [f"train.lr={text}"]).train.lr == float(text)


@FAST
@given(flag=st.booleans(), spelling=st.sampled_from([str.lower, str.upper, str.capitalize]))
def test_bool_override_round_trips(flag, spelling):
    assert load_config(None, [f"model.tie_embeddings={spelling(str(flag))}"]).model.tie_embeddings is flag


_YAML11_WORDS = {"no", "on", "yes", "off", "y", "n"}  # YAML 1.1 reads these as booleans (see test below)


@FAST
@given(
    codes=st.lists(
        st.text(string.ascii_lowercase, min_size=2, max_size=3).filter(lambda c: c not in _YAML11_WORDS), max_size=6
    )
)
def test_language_list_override_round_trips(codes):
    assert load_config(None, [f"data.languages=[{', '.join(codes)}]"]).data.languages == codes


def test_norwegian_language_code_is_a_string():
    assert load_config(None, ["data.languages=[en, no]"]).data.languages == ["en", "no"]


# --- misspelt keys -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("train.max_step=5", "train.max_step", "train.max_steps"),
        ("trian.lr=1", "trian", "train"),
        ("data.worker=2", "data.worker", "data.workers"),
        ("model.n_head=2", "model.n_head", "model.n_heads"),
        ("checkpoint.keep_lst=1", "checkpoint.keep_lst", "checkpoint.keep_last"),
        ("tokenizer.vocab=512", "tokenizer.vocab", "tokenizer.vocab_size"),
        ("sed=1", "sed", "seed"),
    ],
)
def test_misspelt_override_names_key_and_closest(override, key, suggestion):
    msg = config_error(TINY_YAML, [override])
    assert f"unknown config key {key!r}" in msg
    assert msg.endswith(f"did you mean {suggestion}?")


def test_unknown_key_far_from_any_lists_valid_keys():
    msg = config_error(None, ["train.zzzzzzzz=1"])
    assert "'train.zzzzzzzz'" in msg
    assert "valid keys here:" in msg and "max_steps" in msg and "lr" in msg


@FAST
@given(name=st.from_regex(r"[a-z][a-z_]{0,14}", fullmatch=True).filter(lambda n: n not in TrainConfig.model_fields))
def test_any_unknown_train_key_is_refused_on_one_line(name):
    msg = config_error(None, [f"train.{name}=1"])
    assert f"unknown config key 'train.{name}'" in msg


@pytest.mark.parametrize(
    "text, key, suggestion",
    [
        ("train:\n  max_step: 5\n", "train.max_step", "train.max_steps"),
        ("trian:\n  lr: 1\n", "trian", "train"),
        ("data:\n  inputs: [a.warc.gz]\n  worker: 2\n", "data.worker", "data.workers"),
        ("model:\n  dim: 64\n  n_head: 4\n", "model.n_head", "model.n_heads"),
    ],
)
def test_misspelt_key_in_yaml_file(tmp_path, text, key, suggestion):
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    msg = config_error(path)
    assert f"unknown config key {key!r}" in msg and msg.endswith(f"did you mean {suggestion}?")


def test_misspelt_key_in_a_copy_of_tiny_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML.read_text().replace("max_steps: 300", "max_step: 300"))
    assert config_error(path).endswith("did you mean train.max_steps?")


def test_override_can_not_hide_a_typo_in_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  max_step: 5\n")
    assert "'train.max_step'" in config_error(path, ["train.max_steps=5"])


# --- bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "overrides, key, fragments",
    [
        (["train.max_steps=-1"], "train.max_steps", ["greater than or equal to 1", "got -1"]),
        (["train.max_steps=0"], "train.max_steps", ["got 0"]),
        (["train.dtype=fp8"], "train.dtype", ["'fp32', 'bf16' or 'fp16'", "got 'fp8'"]),
        (["train.lr=abc"], "train.lr", ["got 'abc'"]),
        (["train.lr=0"], "train.lr", ["greater than 0"]),
        (["train.threads=1.5"], "train.threads", ["got 1.5"]),
        (["train.max_steps=1e3"], "train.max_steps", ["got '1e3'"]),
        (["data.lang_threshold=1.5"], "data.lang_threshold", ["less than or equal to 1"]),
        (["data.inputs=a.warc.gz"], "data.inputs", ["valid list"]),
        (["train=1"], "train", ["valid dictionary"]),
        (["model.dim=100", "model.n_heads=3"], "model", ["model.dim=100", "divisible by model.n_heads=3"]),
        (["model.n_kv_heads=3"], "model", ["model.n_heads=4", "model.n_kv_heads=3"]),
    ],
)
def test_bad_value_names_the_key(overrides, key, fragments):
    msg = config_error(TINY_YAML, overrides)
    assert msg.startswith(f"bad value for config key {key!r}:")
    for fragment in fragments:
        assert fragment in msg


def test_several_bad_values_are_counted():
    msg = config_error(None, ["train.max_steps=-1", "train.batch_size=0", "train.lr=-1"])
    assert "'train.max_steps'" in msg and "(and 2 more)" in msg


def test_bad_value_in_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  dtype: fp8\n")
    assert config_error(path).startswith("bad value for config key 'train.dtype'")


def test_build_config_validates_a_plain_dict():
    assert build_config({"train": {"max_steps": 3}}, ["train.lr=0.5"]).train.lr == 0.5
    with pytest.raises(ConfigError, match="'train.max_steps'"):
        build_config({"train": {"max_steps": -3}})


# --- broken files ------------------------------------------------------------------------------

def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = config_error(path)
    assert str(path) in msg and "does not exist" in msg


def test_directory_is_not_a_config_file(tmp_path):
    assert str(tmp_path) in config_error(tmp_path)


@pytest.mark.parametrize(
    "text",
    ["train:\n  max_steps: 5\n  lr: [1, 2\n", "train:\n  max_steps: 5\n lr: 3\n", "\ttrain: 1\n", "a: b: c\n"],
    ids=["unclosed-list", "bad-indent", "tab", "nested-colon"],
)
def test_invalid_yaml_names_the_file(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    msg = config_error(path)
    assert msg.startswith(f"config file {path} is not valid YAML")


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_yaml_that_is_not_a_mapping_names_the_file(tmp_path, text, kind):
    path = tmp_path / "scalar.yaml"
    path.write_text(text)
    msg = config_error(path)
    assert str(path) in msg and f"got {kind}" in msg


def test_non_utf8_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# réglages\ntrain:\n  max_steps: 5\n".encode("latin-1"))
    assert str(path) in config_error(path)


def test_invalid_yaml_message_says_where(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 1\ntrain:\n  max_steps: 5\n lr: 3\n")
    assert "line 4" in config_error(path)


# --- the CLI -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "data", "tokenizer", "pack"])
@pytest.mark.parametrize(
    "typo, key, suggestion",
    [("train.max_step=5", "train.max_step", "train.max_steps"), ("trian.lr=1", "trian", "train")],
)
def test_cli_misspelt_key_exits_2_with_one_line_before_any_work(
    tmp_path, capsys, sample_warc, command, typo, key, suggestion
):
    out = tmp_path / "out"
    argv = {
        "run": ["run", str(TINY_YAML), f"out_dir={out}", typo],
        "data": ["data", str(sample_warc), typo, "--out", str(out), "--config", str(TINY_YAML)],
        "tokenizer": [
            "tokenizer",
            "train",
            str(tmp_path / "docs"),
            typo,
            "--out",
            str(out),
            "--config",
            str(TINY_YAML),
        ],
        "pack": ["pack", str(tmp_path / "docs"), typo, "--tokenizer", str(tmp_path / "tok"), "--out", str(out)],
    }[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"kiln: error: unknown config key {key!r}")
    assert lines[0].endswith(f"did you mean {suggestion}?")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_accepts_overrides_after_options(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    argv = [
        "pack",
        str(docs),
        "--tokenizer",
        str(tmp_path / "tok"),
        "--out",
        str(tmp_path / "shards"),
        "pack.seq_len=64",
    ]
    assert main(argv) == 2  # the override is accepted; the command then fails on the missing tokenizer
    assert "no tokenizer at" in capsys.readouterr().err


def test_cli_missing_config_exits_2(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main(["run", str(missing)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kiln: error: config file") and str(missing) in err[0]


def test_config_error_is_a_kiln_error():
    assert issubclass(ConfigError, KilnError)
    with pytest.raises(KilnError):
        load_config(None, ["train.max_step=5"])
