"""`kiln ablate ABLATION.yaml`: judge a data decision by the model it makes.

Each arm (the base config plus overrides) is trained once per seed through Kiln's own stages, every run is
measured on the same held-out sets, and every arm is compared with the baseline by a paired bootstrap over
seeds and eval documents (Holm-corrected): `better`, `worse` or `no detectable difference`.

    spec.py      the ablation file's typed keys, and the proxy scales
    plan.py      every arm's config and every arm x seed run, checked before any work; the folder layout
    evalsets.py  the eval sets, and the check that no arm trained on them (exact hash, MinHash near-dups)
    runner.py    the stages in order (data, shared tokenizer, overlap, pack, train, measure), each resumable
    measure.py   one run measured per eval unit (bits per document, hits per question; torch)
    stats.py     the paired bootstrap, Holm's correction, the verdicts
    results.py   ablation.json
    outdir.py    the out_dir Kiln owns (plan.json's mark, the same ablation file), checked before any write
    report.py    ablation.html
    estimate.py  `kiln ablate --plan`: what each proxy scale costs here and on GPUs
    driver.py    what the command calls: `load`, `ablate`, `report_finished`
"""

from kiln.ablate.driver import ablate, load, report_finished

__all__ = ["ablate", "load", "report_finished"]
