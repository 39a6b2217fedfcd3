"""The [pipeline] section of a manifest (protocols/manifest.py, docs/manifest.md)."""

from __future__ import annotations

import json

import pytest

from protocols import manifest as mf

MINIMAL = 'schema = 1\n[run]\nname = "r"\n'


def error_of(text: str) -> str:
    with pytest.raises(mf.ManifestError) as info:
        mf.parse_manifest(text, source="m.toml")
    return str(info.value)


def test_no_pipeline_keeps_the_run_ids_of_before() -> None:
    # Pinned from the commit before [pipeline] existed (7db2874): adding the section must
    # not change the canonical bytes, so the run-id, of a manifest without one.
    m = mf.parse_manifest(MINIMAL)
    assert m.pipeline is None
    data = mf.canonical_bytes(m)
    assert "pipeline" not in json.loads(data)
    assert mf.run_id(data) == "QmbJita7vMGEyqez8hwZgqt4fSbGk5bKTtbDPt9xfmR8G5"
    assert mf.parse_canonical(data) == m


def test_pipeline_null_is_not_canonical() -> None:
    doc = json.loads(mf.canonical_bytes(mf.parse_manifest(MINIMAL)))
    doc["pipeline"] = None
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(mf.ManifestError, match="not in canonical form"):
        mf.parse_canonical(data)


def test_pipeline_defaults_and_round_trip() -> None:
    m = mf.parse_manifest(MINIMAL + "[pipeline]\nstages = 4\n")
    p = m.pipeline
    assert p is not None
    assert (p.stages, p.layers, p.micro_batches, p.routing, p.recovery, p.lr_boost) == (
        4, (), 4, "random", "checkfree", 1.1)
    assert mf.stage_layers(m.model.n_layers, p.stages, p.layers) == (1, 1, 1, 1)
    data = mf.canonical_bytes(m)
    assert mf.parse_canonical(data, mf.run_id(data)) == m
    assert mf.run_id(data) != mf.run_id(mf.canonical_bytes(mf.parse_manifest(MINIMAL)))


def test_even_split_gives_the_first_stages_the_remainder() -> None:
    assert mf.stage_layers(10, 4) == (3, 3, 2, 2)
    assert mf.stage_layers(6, 3, (0, 6, 0)) == (0, 6, 0)


def test_checkfree_plus_layout_with_embedding_and_head_stages() -> None:
    m = mf.parse_manifest(MINIMAL + '[model]\nn_layers = 6\n[pipeline]\nstages = 8\n'
                          'layers = [0, 1, 1, 1, 1, 1, 1, 0]\nrecovery = "checkfree+"\n')
    assert m.pipeline is not None and m.pipeline.layers == (0, 1, 1, 1, 1, 1, 1, 0)


@pytest.mark.parametrize(("body", "expected"), [
    ("", "m.toml: pipeline.stages: is required"),
    ("stages = 1", "m.toml: pipeline.stages: must be >= 2 (got 1)"),
    ("stages = 2\nstagez = 3", "unknown field 'stagez' in [pipeline]"),
    ('stages = "2"', "m.toml: pipeline.stages: must be an integer"),
    ("stages = 3\nlayers = [1, 3]", "m.toml: pipeline.layers: must list one count per stage (3)"),
    ("stages = 2\nlayers = [1, 2]", "m.toml: pipeline.layers: must add up to model.n_layers = 4"),
    ("stages = 5", "m.toml: pipeline.stages: an even split of model.n_layers = 4"),
    ('stages = 4\nlayers = [1, 0, 2, 1]\nrecovery = "none"',
     "m.toml: pipeline.layers: only the first and last stage may hold 0 layers (stage 1"),
    ("stages = 2\nmicro_batches = 5", "m.toml: pipeline.micro_batches: must divide "
                                      "train.batch_size = 16 (got 5)"),
    ("stages = 2\nlayers = [3, 1]", 'm.toml: pipeline.recovery: "checkfree" rebuilds'),
    ("stages = 2", 'm.toml: pipeline.recovery: "checkfree" needs an interior stage'),
    ('stages = 3\nlayers=[0, 4, 0]\nrecovery = "checkfree+"',
     'm.toml: pipeline.recovery: "checkfree+" swaps the first two'),
    ('stages = 2\nrecovery = "checkfree++"', "m.toml: pipeline.recovery: must be one of"),
    ("stages = 2\nlr_boost = 0.5", "m.toml: pipeline.lr_boost: must be >= 1"),
    ("stages = 2\nlr_boost = nan", "m.toml: pipeline.lr_boost: must be a finite number"),
    ('stages = 2\nrouting = "roundrobin"', "m.toml: pipeline.routing: must be one of"),
])
def test_bad_pipeline_sections_name_their_field(body: str, expected: str) -> None:
    assert expected in error_of(MINIMAL + "[pipeline]\n" + body + "\n")


def test_pipeline_needs_the_builtin_gpt() -> None:
    err = error_of(MINIMAL + '[model]\ntask = "digits-mlp"\n[pipeline]\nstages = 2\n'
                   'recovery = "none"\n')
    assert err.startswith("m.toml: pipeline.stages: a pipeline cuts the built-in byte-level GPT")
    err = error_of(MINIMAL + '[model]\nfactory = "a.b:c"\n[pipeline]\nstages = 2\n'
                   'recovery = "none"\n')
    assert "model.factory" in err
