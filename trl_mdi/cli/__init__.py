"""The command-line side of trl_mdi, apart from the library: the training entry point behind
``examples/scripts/grpo_vlm.py`` and the generator of the reference tables in docs/.

Layout: ``command`` (``main``: parse, check, print, train, save), ``arguments`` (the parser, its defaults and each
value's provenance), ``checks`` (what is checked before any weight loads), ``run_report`` (what the entry point
prints: the effective configuration and the outputs written), ``config_doc`` (``python -m trl_mdi.cli.config_doc``:
docs/config.md's table and docs/logs.md's signal glossary, generated from the code).

Nothing is imported here, so ``trl_mdi.profile``, which shares the entry point's errors (``arguments``) and model
checks (``checks``), does not load the training command.
"""
