"""Coverage-guided fuzzing of every decoder in protocols/ (atheris / libFuzzer).

`python -m tests.fuzz --target all --seconds 60` runs each target for a minute and prints
executions, coverage and crashes (docs/robustness.md records a run); tests/protocols/test_fuzz.py
runs a short, seeded, fixed-count version in CI. Targets and their invariants:
tests/fuzz/targets.py. Nothing here is imported before atheris instruments protocols/.
"""
