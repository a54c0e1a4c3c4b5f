"""The project's benchmarks: each one a script run from the repository root as ``python -m benchmarks.<name>``
(benchmarks/README.md lists them), which writes its own section of benchmarks/RESULTS.md.

Shared parts, written once: ``results`` (offline settings, RESULTS.md sections, code versions, running and saving
one job of a pool), ``stats`` (paired seed differences, t intervals, verdicts), ``callbacks`` (held-out evaluation
every N steps of a GRPO run) and ``variants`` (a training variant and its CPU GRPO config). Nothing is imported
here: ``gpu_probe`` runs on a machine with only torch, transformers and trl's wheel.
"""
