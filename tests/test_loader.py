"""The training loader: global order, rank slices, exact resume, prefetch, pinned memory, mixing, remote shards.

Covered, on the session's `prepared` shards (real memmapped files) and small packs made here:
- the global batch is the same set of samples for world sizes 1 and 2 (rank slices
  concatenated == the world-1 batch), with and without prefetch;
- an epoch visits every sample once; the remainder smaller than a batch starts a new epoch;
- resume: a state saved after every batch of two epochs, and at arbitrary positions that
  are not batch multiples, continues exactly (world 1 and 2, saved under one world size
  and resumed under the other), no sample repeated or skipped;
- prefetch: `state` is that of the batches handed out, not of those prefetched; an error in
  the prefetch thread surfaces from `next_batch`;
- batches are pinned exactly when CUDA is available (no GPU here: the CPU branch runs);
- mixing: per-epoch draws follow the weights exactly (largest remainder), are spread over
  the epoch, deterministic per seed, repeat an upsampled source evenly; mismatched sources
  and partial weights are refused;
- remote shards (fsspec `memory://` and `file://` URLs) read through the cache give the
  same samples as the local folder, are stored by sha256, stay within the size bound, and
  a corrupted remote file stops with an IntegrityError naming its URL.
"""

from __future__ import annotations

import hashlib
import json

import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from conftest import tiny_config
from kiln.config import PackConfig
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest
from kiln.shards.format import FILES_TABLE
from kiln.shards.reader import ShardSet
from kiln.shards.pack import pack
from kiln.shards.remote import ShardCache
from kiln.train.data import Mixture, draws_per_source, open_splits
from kiln.train.loader import Loader


@pytest.fixture(scope="module")
def samples(prepared) -> ShardSet:
    return ShardSet(prepared.out / "shards", "train")


def rows(samples, idx: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(samples.sample(int(i)), dtype=np.int64) for i in idx]))


def global_batch(loaders: list[Loader]) -> torch.Tensor:
    """One step of every rank, in rank order: the global batch."""
    return torch.cat([torch.cat(loader.next_batch()) for loader in loaders])


# --- order and rank slices ------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 3])
def test_global_batch_is_the_same_for_world_sizes_1_and_2(samples, prefetch):
    one = Loader(samples, 8, 4, 0, 1, seed=3, prefetch=prefetch)
    two = [Loader(samples, 8, 2, r, 2, seed=3, prefetch=prefetch) for r in range(2)]
    reference = Loader(samples, 8, 8, 0, 1, seed=3)
    for _ in range(6):
        whole = global_batch([one])
        assert whole.shape == (8, samples.sample_len) and whole.dtype == torch.int64
        assert torch.equal(whole, global_batch(two))
        assert torch.equal(whole, rows(samples, reference.next_global_indices()))  # the data behind the indices
    assert [len(b) for b in two[0].next_batch()] == [2, 2]  # micro-batches of micro_batch rows


def test_each_epoch_visits_every_sample_once(samples):
    n = len(samples)
    loader = Loader(samples, 16, 16, 0, 1, seed=11)
    epoch = np.concatenate([loader.next_global_indices() for _ in range(n // 16)])
    assert len(epoch) == n // 16 * 16 and len(np.unique(epoch)) == len(epoch)
    assert loader.state.epoch == 0 and loader.state.position == n // 16 * 16
    nxt = loader.next_global_indices()  # the remainder (< one batch) is skipped: a new permutation starts
    assert loader.state.epoch == 1 and loader.state.position == 16
    assert not np.array_equal(nxt, epoch[:16])
    other = Loader(samples, 16, 16, 0, 1, seed=12)
    assert not np.array_equal(other.next_global_indices(), epoch[:16])  # the seed matters


def test_loader_rejects_indivisible_or_oversized_batch(samples):
    with pytest.raises(ValueError, match="multiple of"):
        Loader(samples, 6, 4, 0, 1, seed=0)
    with pytest.raises(ValueError, match="multiple of micro_batch_size×world = 2×2"):
        Loader(samples, 6, 2, 0, 2, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        Loader(samples, len(samples) + 1, 1, 0, 1, seed=0)


# --- exact resume -----------------------------------------------------------------------------------

def test_resume_after_every_batch_of_two_epochs_world_1_and_2(samples):
    gb = 64
    per_epoch = len(samples) // gb
    ref = Loader(samples, gb, gb, 0, 1, seed=5)
    stream, states = [], []
    for _ in range(2 * per_epoch + 3):
        states.append(ref.state_dict())
        stream.append(ref.next_global_indices())
    assert states[per_epoch + 1] == {"seed": 5, "epoch": 1, "position": gb}
    for k in range(len(stream) - 3):
        for world in (1, 2):
            loader = Loader(samples, gb, gb // world, 0, world, seed=999)  # the saved seed wins
            loader.load_state_dict(states[k])
            for j in range(3):
                assert np.array_equal(loader.next_global_indices(), stream[k + j]), (k, world, j)


@pytest.mark.parametrize("saved_world,resumed_world", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_resume_mid_run_keeps_the_global_order_across_world_sizes(samples, saved_world, resumed_world):
    gb = 8
    reference = Loader(samples, gb, gb, 0, 1, seed=21)
    expected = [global_batch([reference]) for _ in range(7)]
    before = [Loader(samples, gb, gb // saved_world, r, saved_world, seed=21, prefetch=2) for r in range(saved_world)]
    got = [global_batch(before) for _ in range(3)]
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)  # every rank holds the same state
    after = [
        Loader(samples, gb, gb // resumed_world, r, resumed_world, seed=0, prefetch=2) for r in range(resumed_world)
    ]
    for loader in after:
        loader.load_state_dict(state)
    got += [global_batch(after) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("position", [0, 1, 5, 63, 1001])
def test_resume_at_a_position_that_is_not_a_batch_multiple(samples, position):
    """A checkpoint from a run with another batch size: the order continues from the very next draw."""
    order = Mixture([samples]).epoch_order(7, 2)
    for world in (1, 2):
        loader = Loader(samples, 16, 8 // world, 0, world, seed=7)
        loader.load_state_dict({"seed": 7, "epoch": 2, "position": position})
        taken = np.concatenate([loader.next_global_indices() for _ in range(4)])
        assert np.array_equal(taken, order[position: position + 64])
        assert loader.state_dict() == {"seed": 7, "epoch": 2, "position": position + 64}


def test_no_sample_repeated_or_skipped_across_a_resume(samples):
    gb = 32
    per_epoch = len(samples) // gb
    a = Loader(samples, gb, gb, 0, 1, seed=8, prefetch=2)
    first = [a.next_global_indices() for _ in range(per_epoch // 3)]
    b = Loader(samples, gb, gb, 0, 1, seed=8)
    b.load_state_dict(a.state_dict())
    rest = [b.next_global_indices() for _ in range(per_epoch - per_epoch // 3)]
    epoch = np.concatenate(first + rest)
    assert len(epoch) == per_epoch * gb == len(np.unique(epoch))


# --- prefetch and pinned memory ---------------------------------------------------------------------

def test_prefetch_state_is_that_of_batches_handed_out(samples):
    plain = Loader(samples, 8, 8, 0, 1, seed=4)
    ahead = Loader(samples, 8, 4, 0, 1, seed=4, prefetch=4)
    for n in range(1, 6):
        got = torch.cat(ahead.next_batch())
        assert torch.equal(got, torch.cat(plain.next_batch()))
        assert ahead.state_dict() == plain.state_dict() == {"seed": 4, "epoch": 0, "position": 8 * n}
    queue = ahead._running[0].queue
    for _ in range(250):  # the thread really runs ahead: it fills its queue
        if queue.full():
            break
        time.sleep(0.02)
    assert queue.full()
    assert ahead.state.position == 40  # ...but the state is still that of the 5 batches handed out
    resumed = Loader(samples, 8, 8, 0, 1, seed=0, prefetch=2)
    resumed.load_state_dict(ahead.state_dict())
    for _ in range(3):
        assert torch.equal(torch.cat(resumed.next_batch()), torch.cat(plain.next_batch()))
    ahead.load_state_dict({"seed": 4, "epoch": 0, "position": 0})  # restarts the thread from the new state
    assert torch.equal(torch.cat(ahead.next_batch()), torch.cat(Loader(samples, 8, 8, 0, 1, seed=4).next_batch()))
    ahead.close()
    assert not ahead._running


def test_an_abandoned_loader_stops_its_prefetch_thread(samples):
    import gc
    import threading

    before = {t.ident for t in threading.enumerate() if t.name == "kiln-prefetch"}
    loader = Loader(samples, 8, 8, 0, 1, seed=4, prefetch=2)
    loader.next_batch()
    thread = loader._running[0].thread
    assert thread.is_alive() and thread.ident not in before
    del loader
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_batches_are_pinned_exactly_when_a_gpu_is_present(samples):
    # No GPU here: this runs the CPU branch (plain memory); on a GPU machine it checks the pinned one.
    for prefetch in (0, 2):
        batch = Loader(samples, 8, 4, 0, 1, seed=1, prefetch=prefetch).next_batch()
        assert all(b.is_pinned() == torch.cuda.is_available() for b in batch)


# --- mixing -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def second_source(prepared, tmp_path_factory) -> Path:
    """A small second shards folder packed with the same tokenizer and sequence length."""
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta kiln shard token mixing weights source".split()
    docs = [
        {"id": f"mix-{i}", "text": " ".join(rng.choice(words, size=int(rng.integers(20, 200))))} for i in range(300)
    ]
    out = tmp_path_factory.mktemp("mix") / "shards"
    pack(docs, prepared.out / "tokenizer", out, PackConfig(seq_len=prepared.pack.seq_len, val_fraction=0.2,
                                                             samples_per_shard=50))
    return out


def test_draws_per_source_is_largest_remainder():
    assert draws_per_source([10, 10], [1, 1]).tolist() == [10, 10]
    assert draws_per_source([10, 10], [3, 1]).tolist() == [15, 5]
    assert draws_per_source([7, 0, 3], [1, 1, 1]).tolist() == [4, 3, 3]
    assert draws_per_source([100, 1], [1, 2]).tolist() == [34, 67]
    assert draws_per_source([5, 5, 5], [1, 1, 1]).sum() == 15


def test_mixture_follows_the_weights_exactly_and_deterministically(samples, second_source):
    b = ShardSet(second_source, "train")
    mix = Mixture([samples, b], [3.0, 1.0])
    n = len(samples) + len(b)
    assert len(mix) == n and mix.counts.tolist() == draws_per_source([len(samples), len(b)], [3, 1]).tolist()
    order = mix.epoch_order(seed=9, epoch=0)
    from_b = order >= len(samples)
    assert len(order) == n and int(from_b.sum()) == mix.counts[1]
    assert abs(from_b.mean() - 0.25) < 1e-3
    for window in np.array_split(from_b, 20):  # spread over the epoch, not in blocks
        assert 0.15 < window.mean() < 0.35
    # the small source is upsampled: each of its samples drawn floor or ceil of counts/size times
    reps = np.bincount(order[from_b] - len(samples), minlength=len(b))
    assert reps.min() >= mix.counts[1] // len(b) and reps.max() <= -(-mix.counts[1] // len(b))
    assert np.array_equal(order, Mixture([samples, b], [3.0, 1.0]).epoch_order(9, 0))
    assert not np.array_equal(order, mix.epoch_order(10, 0))
    assert not np.array_equal(order, mix.epoch_order(9, 1))
    # the batches carry those samples' tokens
    loader = Loader(mix, 16, 8, 0, 1, seed=9)
    batch = torch.cat(loader.next_batch())
    assert torch.equal(batch, rows(mix, order[:16]))
    assert torch.equal(rows(mix, [len(samples)]), rows(b, [0]))


def test_open_splits_mixes_config_sources_and_refuses_partial_weights(prepared, second_source, tmp_path):
    sha = read_manifest(second_source)["tokenizer_sha256"]
    cfg = tiny_config(tmp_path / "o", loader={"sources": [
        {"path": str(prepared.out / "shards"), "weight": 1.0}, {"path": f"file://{second_source}", "weight": 1.0}]})
    train, val = open_splits(cfg, sha)
    assert train.counts[0] == train.counts[1] or abs(int(train.counts[0]) - int(train.counts[1])) == 1
    assert len(val) == len(ShardSet(prepared.out / "shards", "val")) + len(ShardSet(second_source, "val"))
    assert int(train.manifest["vocab_size"]) == read_manifest(second_source)["vocab_size"]
    bad = tiny_config(tmp_path / "o", loader={"sources": [{"path": str(prepared.out / "shards"), "weight": 1.0},
                                                          {"path": str(second_source)}]})
    with pytest.raises(KilnError, match=r"loader.sources\[1\].weight"):
        open_splits(bad, sha)
    default_train, _ = open_splits(tiny_config(prepared.out), sha)
    assert len(default_train) == len(ShardSet(prepared.out / "shards", "train")) and default_train.weights is None


def test_mixing_sources_of_different_sequence_length_is_refused(prepared, tmp_path, samples):
    docs = [{"id": f"x{i}", "text": "some words to pack " * 40} for i in range(30)]
    other = tmp_path / "other"
    pack(docs, prepared.out / "tokenizer", other, PackConfig(seq_len=31, val_fraction=0.0))
    with pytest.raises(KilnError, match="sample_len 32 differs"):
        Mixture([samples, ShardSet(other, "train")], [1, 1])


# --- remote shards through the cache ------------------------------------------------------------------

def upload(local: Path, url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{root}/{p.relative_to(local).as_posix()}", p.read_bytes())


@pytest.fixture
def remote(second_source):
    url = f"memory://kiln-test-{uuid.uuid4().hex[:8]}/shards"
    upload(second_source, url)
    yield url
    fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)


def test_remote_shards_read_through_the_cache_match_local(second_source, remote, tmp_path):
    local = ShardSet(second_source, "train")
    cache = ShardCache(tmp_path / "cache", 10**9)
    far = ShardSet(remote, "train", cache=cache)
    assert len(far) == len(local) and not list((tmp_path / "cache").rglob("*"))  # nothing fetched before use
    for i in range(len(local)):
        assert np.array_equal(far.sample(i), local.sample(i))
    m = read_manifest(second_source)
    cached = {p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert cached == {m["files"][n]["sha256"] for n in local.names}  # content-addressed, only what was read
    loader = Loader(far, 8, 8, 0, 1, seed=2, prefetch=2)
    assert torch.equal(torch.cat(loader.next_batch()), torch.cat(Loader(local, 8, 8, 0, 1, seed=2).next_batch()))
    # file:// goes through the cache too
    via_file = ShardSet(f"file://{second_source}", "train", cache=ShardCache(tmp_path / "c2", 10**9))
    assert np.array_equal(via_file.sample(len(local) - 1), local.sample(len(local) - 1))


def test_cache_stays_within_its_size_bound(second_source, remote, tmp_path):
    local = ShardSet(second_source, "train")
    sizes = [read_manifest(second_source)["files"][n]["size"] for n in local.names]
    assert len(sizes) >= 3
    bound = max(sizes) * 2
    cache = ShardCache(tmp_path / "cache", bound)
    far = ShardSet(remote, "train", cache=cache)
    for i in list(range(0, len(local), 5)) * 2:  # every shard, twice: fetched, evicted, fetched again
        assert np.array_equal(far.sample(i), local.sample(i))
        assert sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file()) <= bound
    with pytest.raises(KilnError, match="do not fit the shard cache"):
        ShardSet(remote, "train", cache=ShardCache(tmp_path / "tiny", max(sizes) - 1)).sample(0)


def test_corrupted_remote_shard_is_refused_naming_its_url(second_source, remote, tmp_path):
    name = read_manifest(second_source)["splits"]["train"]["files"][1]
    fs, root = fsspec.core.url_to_fs(remote)
    raw = bytearray(fs.cat_file(f"{root}/{name}"))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(f"{root}/{name}", bytes(raw))
    far = ShardSet(remote, "train", cache=ShardCache(tmp_path / "cache", 10**9))
    far.sample(0)  # the first shard is intact
    with pytest.raises(IntegrityError, match=f"{remote}/{name}: .* sha256 .*corrupt") as info:
        far.sample(int(far.starts[1]))
    assert "re-upload" in str(info.value)
    m = read_manifest(second_source)
    cached = {p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert cached == {m["files"][m["splits"]["train"]["files"][0]]["sha256"]}  # the corrupt copy was not kept
    # the same error from the prefetch thread surfaces in next_batch
    loader = Loader(ShardSet(remote, "train", cache=ShardCache(tmp_path / "c3", 10**9)), len(far), len(far), 0, 1,
                    seed=0, prefetch=2)
    with pytest.raises(IntegrityError, match="corrupt"):
        loader.next_batch()


def test_remote_manifest_without_a_listed_shards_checksum_is_a_clear_error(second_source, remote, tmp_path):
    # was a bare KeyError from the files table
    fs, root = fsspec.core.url_to_fs(remote)
    manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
    name = read_manifest(second_source)["splits"]["train"]["files"][0]
    rows = [json.loads(line) for line in fs.cat_file(f"{root}/{FILES_TABLE}").decode().splitlines()]
    for row in rows:  # the shard stays in the split's list, its size and sha256 go
        if row["name"] == name:
            del row["size"], row["sha256"]
    table = "".join(json.dumps(row) + "\n" for row in rows).encode()
    fs.pipe_file(f"{root}/{FILES_TABLE}", table)
    manifest["files"][FILES_TABLE] = {"size": len(table), "sha256": hashlib.sha256(table).hexdigest()}
    fs.pipe_file(f"{root}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(
        IntegrityError, match=f"manifest.json: its 'files' table has no size and sha256 for {name}; re-upload"
    ):
        ShardSet(remote, "train", cache=ShardCache(tmp_path / "cache", 10**9))


def test_corrupted_remote_file_table_is_refused_naming_its_url(remote, tmp_path):
    fs, root = fsspec.core.url_to_fs(remote)
    raw = bytearray(fs.cat_file(f"{root}/{FILES_TABLE}"))
    raw[len(raw) // 2] ^= 0x01
    fs.pipe_file(f"{root}/{FILES_TABLE}", bytes(raw))
    with pytest.raises(IntegrityError, match=f"{remote}/{FILES_TABLE}: .* sha256 .* changed after Kiln wrote it"):
        ShardSet(remote, "train", cache=ShardCache(tmp_path / "cache", 10**9))
    fs.rm(f"{root}/{FILES_TABLE}")
    with pytest.raises(IntegrityError, match=f"{remote}/{FILES_TABLE}: listed in manifest.json but missing"):
        ShardSet(remote, "train", cache=ShardCache(tmp_path / "cache", 10**9))


def test_missing_remote_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(IntegrityError, match="manifest.json: not found"):
        ShardSet(f"memory://nothing-{uuid.uuid4().hex[:6]}/shards", "train", cache=ShardCache(tmp_path, 10**6))
    with pytest.raises(KilnError, match="local cache"):
        ShardSet("memory://x/shards", "train")


def test_weight_from_the_data_stage_scales_a_source_share(prepared, tmp_path):
    """`weight: data`: a source's share is its size times the data stage's distribution weight,
    averaged over its training tokens (recorded by pack as `data_weight`)."""
    from kiln.data.docs import read_docs

    docs = prepared.out / "docs"
    sources = {d["source"] for d in read_docs(docs)}
    cfg = PackConfig(seq_len=64, val_fraction=0.1)
    plain = pack(read_docs(docs), prepared.out / "tokenizer", tmp_path / "plain", cfg)
    drifted = pack(read_docs(docs), prepared.out / "tokenizer", tmp_path / "drifted", cfg,
                   source_weights={s: {"weight": 0.25, "z": 4.0} for s in sources})
    assert plain["data_weight"] == 1.0 and drifted["data_weight"] == 0.25
    run = tiny_config(tmp_path / "run", loader={"sources": [{"path": str(tmp_path / "plain"), "weight": "data"},
                                                            {"path": str(tmp_path / "drifted"), "weight": "data"}]})
    train, _ = open_splits(run, plain["tokenizer_sha256"])
    a, b = train.counts.tolist()
    assert a == pytest.approx(4 * b, abs=2) and a + b == len(train)
