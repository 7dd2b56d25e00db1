"""`kiln mix MIX.yaml`: choose the data mixture by the model.

A swarm of proxy runs on mixtures drawn around the sources' natural shares, a regression from weights to every
eval metric (cross-validated before it is trusted), the weights that minimise the predicted target under the
repetition limit, and the proof: an ablation (kiln.ablate's runner and statistics) of the proposed, the natural
and the best swarm run's mixtures on several seeds.

    spec.py      the mix file's typed keys (eval, statistics and proxy as an ablation file's)
    swarm.py     the budget, the repetition limit's caps, the Dirichlet draws
    fit.py       the log-linear (and log-quadratic) regression and its cross-validation
    propose.py   scipy's optimisation of the predicted target on the capped simplex
    driver.py    what the command calls: `load`, `mix`, `report_finished`; the steps in order
    report.py    mix.html and the console summary
"""

from kiln.mix.driver import load, mix, report_finished

__all__ = ["load", "mix", "report_finished"]
