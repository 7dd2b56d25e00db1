"""The model: config.py (the `model:` section, pydantic only), llama.py and moe.py (the architecture), loss.py
(next-token cross-entropy), build.py (build_model). Pure math, no I/O, no distributed code, nothing from kiln
outside kiln.model (tests/test_layout.py checks it).

Nothing is imported here: `kiln.config` reads model/config.py, and that must not load torch."""
