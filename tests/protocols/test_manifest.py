"""Run manifests and run-ids (protocols/manifest.py): bytes and text in, no I/O but tmp files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import tomllib

import base58
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import manifest as mf
from testnet import launcher

DEFAULT = launcher.default_manifest_path()
PEER = "12D3KooWGzBPvbMbXe1CsGDyqFsQnkJ3tSXEFR8YZYjTDGCYkmCE"  # an Ed25519 libp2p peer id
MINIMAL = 'schema = 1\n[run]\nname = "r"\n'


def default_text() -> str:
    return DEFAULT.read_text(encoding="utf-8")


def rid(m: mf.Manifest) -> str:
    return mf.run_id(mf.canonical_bytes(m))


def error_of(text: str | bytes) -> str:
    with pytest.raises(mf.ManifestError) as info:
        mf.parse_manifest(text, source="m.toml")
    return str(info.value)


# -- the demo manifest and the stability of its id --------------------------------------


def test_default_manifest_parses():
    m = mf.load_manifest_file(DEFAULT)
    assert m.schema_version == 1
    assert m.run.name == "testnet-default"
    assert (m.model.task, m.data.source) == ("bytes-gpt", "stdlib")
    assert (m.model.d_model, m.model.n_layers, m.model.n_heads, m.model.context) == (
        128, 2, 4, 128)
    assert m.train.batch_size == 16
    assert (m.outer.algorithm, m.outer.inner_steps) == ("noloco", 20)


def test_default_manifest_run_id_is_pinned():
    """The canonical form is a protocol: peers running other builds must derive the same id.

    If this fails, either the demo manifest changed on purpose (update the id here and
    anywhere it was published) or the canonical form changed by accident (a new field, a
    new default, a different JSON spelling), which splits every existing run: bump SCHEMA.
    """
    assert rid(mf.load_manifest_file(DEFAULT)) == "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"


def test_defaults_written_out_or_left_out_give_the_same_id():
    everything = mf.parse_manifest(default_text())
    only_what_differs = mf.parse_manifest(
        'schema = 1\n[run]\nname = "testnet-default"\n'
        'description = "Local testnet demo: byte-level GPT on the CPython stdlib sources."\n'
        "[model]\nn_layers = 2\n[outer]\ninner_steps = 20\n")
    assert only_what_differs == everything
    assert rid(only_what_differs) == rid(everything)
    no_schema_line = mf.parse_manifest('[run]\nname = "r"\n')
    assert rid(no_schema_line) == rid(mf.parse_manifest(MINIMAL))


def test_run_id_ignores_comments_order_spacing_and_number_spelling():
    text = default_text()
    rewritten = to_toml(tomllib.loads(text), random.Random(7))  # shuffled, other comments
    for old, new in [("lr = 0.002", "lr = 2e-3"), ("total_steps = 100000", "total_steps=100_000"),
                     ("weight_decay = 0.1", "weight_decay = 1e-1"), ("keep = 3", "keep = 0x3")]:
        assert old in rewritten
        rewritten = rewritten.replace(old, new)
    def sections(t: str) -> list[str]:
        return re.findall(r"^\[(\w+)\]", t, flags=re.MULTILINE)

    assert "# a comment" in rewritten and sections(rewritten) != sections(text)
    assert sorted(sections(rewritten)) == sorted(sections(text))
    same = rid(mf.parse_manifest(text))
    assert rid(mf.parse_manifest(rewritten)) == same
    assert rid(mf.parse_manifest(text.replace("\n", "\r\n"))) == same
    assert rid(mf.parse_manifest(("\ufeff" + text).encode())) == same  # a byte-order mark


@pytest.mark.parametrize(("old", "new"), [
    ('name = "testnet-default"', 'name = "testnet-default2"'),
    ("seed = 0", "seed = 1"),
    ("n_layers = 2", "n_layers = 3"),
    ('task = "bytes-gpt"', 'task = "digits-mlp"'),
    ("lr = 2e-3", "lr = 2.0000000000000004e-3"),  # the next float up
    ("inner_steps = 20", "inner_steps = 50"),       # back to the default: still a change
    ("nesterov = false", "nesterov = true"),
    ('codec = "bf16"', 'codec = "int8"'),
    ("admins = []", f'admins = ["{PEER}"]'),
    ('description = "Local', 'description = "local'),
])
def test_any_semantic_change_changes_the_run_id(old, new):
    text = default_text()
    assert old in text
    assert rid(mf.parse_manifest(text.replace(old, new, 1))) != rid(mf.parse_manifest(text))


def test_canonical_bytes_shape():
    data = mf.canonical_bytes(mf.parse_manifest(MINIMAL + 'description = "Grüße ✓"\n'))
    assert data.startswith(b'{"aggregate":{"method":"mean","neighbours":1},"checkpoint":')
    assert b" " not in data.replace(b"Gr\xc3\xbc\xc3\x9fe \xe2\x9c\x93", b"")
    assert "Grüße ✓".encode() in data  # UTF-8, not \u escapes
    doc = json.loads(data)
    assert list(doc) == sorted(doc) and doc["schema"] == 1
    assert doc["train"]["lr"] == 0.002 and doc["network"]["admins"] == []
    r = mf.run_id(data)
    assert len(r) == 46 and r.startswith("Qm")
    assert base58.b58decode(r) == b"\x12\x20" + hashlib.sha256(data).digest()


def test_ints_in_float_fields_and_negative_zero_are_one_value():
    a = mf.parse_manifest(MINIMAL + "[train]\nlr = 1\nweight_decay = -0.0\n")
    b = mf.parse_manifest(MINIMAL + "[train]\nlr = 1.0\nweight_decay = 0.0\n")
    assert isinstance(a.train.lr, float) and a == b and rid(a) == rid(b)
    assert b'"lr":1.0' in mf.canonical_bytes(a)


def test_manifest_is_immutable():
    m = mf.parse_manifest(MINIMAL + f'[network]\nadmins = ["{PEER}"]\n')
    with pytest.raises(ValueError, match="frozen"):
        m.model.d_model = 256  # type: ignore[misc]
    with pytest.raises(ValueError, match="frozen"):
        m.run = m.run  # type: ignore[misc]
    assert m.network.admins == (PEER,) and isinstance(m.data.paths, tuple)
    assert hash(m) == hash(mf.parse_manifest(MINIMAL + f'[network]\nadmins = ["{PEER}"]\n'))


# -- bad input: every class of mistake names its field -----------------------------------

BAD = [
    # (TOML after [run] name = "r", expected field path, expected words of the reason)
    ("[outer]\ninner_steps = 0", "outer.inner_steps", "must be >= 1 (got 0)"),
    ('[train]\nbatch_size = "16"', "train.batch_size", 'must be an integer (got "16", a string)'),
    ("[train]\nbatch_size = true", "train.batch_size", "must be an integer (got true, a boolean)"),
    ("[train]\nbatch_size = 16.0", "train.batch_size", "must be an integer (got 16.0, a float)"),
    ("[train]\nlr = true", "train.lr", "must be a number (got true"),
    ('[train]\nlr = "0.1"', "train.lr", "must be a number"),
    ("[outer]\nnesterov = 1", "outer.nesterov", "must be true or false (got 1, an integer)"),
    ("[train]\nlr = 0", "train.lr", "must be > 0"),
    ("[train]\nlr = 1.5", "train.lr", "must be <= 1 (got 1.5)"),
    ("[train]\nlr = nan", "train.lr", "must be a finite number (got nan)"),
    ("[train]\ngrad_clip = inf", "train.grad_clip", "must be a finite number (got inf)"),
    ("[train]\nweight_decay = -0.1", "train.weight_decay", "must be >= 0"),
    ("[train]\nthreads = 0", "train.threads", "must be >= 1"),
    ("[data]\nval_fraction = 0.5", "data.val_fraction", "must be < 0.5"),
    ("[data]\nval_fraction = 0", "data.val_fraction", "must be > 0"),
    ("[model]\nd_model = 16385", "model.d_model", "must be <= 16384"),
    ("[model]\ncontext = 65537", "model.context", "must be <= 65536"),
    ("[model]\nn_layers = 513", "model.n_layers", "must be <= 512"),
    ("[model]\nn_heads = 5", "model.n_heads", "must divide d_model = 128 evenly (got 5)"),
    ("[model]\nd_model = 130", "model.n_heads", "must divide d_model = 130 evenly (got 4)"),
    ('[model]\nfactory = "mymodel"', "model.factory", 'must be "package.module:callable"'),
    ('[model]\nfactory = "a.b:c d"', "model.factory", "package.module:callable"),
    ('[model]\nfactory = "a.class:build"', "model.factory", "package.module:callable"),
    ('[model]\ntask = "bytes_gpt"', "model.task", 'must be one of "bytes-gpt", "digits-mlp" '
                                                  '(got "bytes_gpt") (did you mean "bytes-gpt"?)'),
    ('[outer]\nalgorithm = "adam"', "outer.algorithm",
     'must be one of "noloco", "gossip", "diloco"'),
    ('[outer]\ncodec = "fp16"', "outer.codec", '"fp32", "bf16", "int8"'),
    ("[outer]\ngroup_size = 1", "outer.group_size", "must be >= 2"),
    ("[outer]\nmomentum = 1.0", "outer.momentum", "must be < 1"),
    ('[aggregate]\nmethod = "sybil"', "aggregate.method", 'did you mean "sybilwall"?'),
    ("[checkpoint]\nkeep = 0", "checkpoint.keep", "must be >= 1"),
    ('[data]\nsource = "files"', "data.paths", 'at least one file or directory when source = '
                                               '"files"'),
    ('[data]\nsource = "files"\npaths = "a.txt"', "data.paths", "must be an array (got "),
    ('[data]\npaths = ["a.txt", ""]', "data.paths[1]", "must not be empty"),
    ('[data]\nformat = "csv"', "data.format", 'must be one of "text", "jsonl"'),
    ("[network]\nbootstrap = ['localhost:4001']", "network.bootstrap[0]",
     'must be a peer multiaddr like /ip4/<address>/tcp/<port>/p2p/<peer-id> (got "localhost'),
    ("[network]\nbootstrap = ['/ip4/1.2.3.4/tcp/1']", "network.bootstrap[0]", "peer multiaddr"),
    (f"[network]\nadmins = ['{PEER}', 'bob']", "network.admins[1]",
     'must be a libp2p peer id: 46 to 60 base58 characters, like 12D3KooW... (got "bob")'),
    (f"[network]\nadmins = ['{PEER[:-1]}0']", "network.admins[0]", "libp2p peer id"),
    ("[network]\nadmins = [3]", "network.admins[0]", "must be a string (got 3, an integer)"),
    ("[network]\nadmins = 'x'", "network.admins", "must be an array"),
    ("[model]\nmodle = 3", "model.modle", "unknown field 'modle' in [model]"),
    ("[outer]\ninner_step = 3", "outer.inner_step",
     "unknown field 'inner_step' in [outer] (did you mean 'inner_steps'?)"),
    ("[model.extra]\nx = 1", "model.extra", "unknown field 'extra' in [model]"),
    ("[train]\nlr = [0.1]", "train.lr", "must be a number (got an array)"),
    ("[train]\nlr = 2026-01-01", "train.lr", "must be a number (got 2026-01-01, a date/time)"),
]


@pytest.mark.parametrize(("toml", "path", "reason"), BAD, ids=[b[1] for b in BAD])
def test_bad_field_names_its_path_and_reason(toml, path, reason):
    message = error_of(MINIMAL + toml + "\n")
    assert message.startswith(f"m.toml: {path}: "), message
    assert reason in message, message
    assert "\n" not in message  # one problem, one line
    for noise in ("pydantic", "Input should", "Traceback", "errors.pydantic.dev", "For further"):
        assert noise not in message


@pytest.mark.parametrize(("toml", "expected"), [
    ('modle = {}\n[run]\nname = "r"',
     "m.toml: modle: unknown field 'modle' at the top level (did you mean 'model'?)"),
    ("schema = 1", "m.toml: run: missing section [run] (every manifest needs one, with at least "
                   "a name)"),
    ("[run]\nseed = 1", "m.toml: run.name: is required"),
    ('[run]\nname = ""', "m.toml: run.name: must not be empty"),
    ('[run]\nname = "my run"', "m.toml: run.name: may use only letters, digits, '.', '_' and '-' "
                               '(got "my run")'),
    (f'[run]\nname = "{"x" * 65}"', "m.toml: run.name: must be at most 64 characters (got 65)"),
    (f'[run]\nname = "r"\ndescription = "{"x" * 2001}"',
     "m.toml: run.description: must be at most 2000 characters (got 2001)"),
    ('[run]\nname = "r"\nseed = -1', "m.toml: run.seed: must be >= 0 (got -1)"),
    ('model = 3\n[run]\nname = "r"', "m.toml: model: must be a table (got 3, an integer)"),
    ('run = "r"', 'm.toml: run: must be a table (got "r", a string)'),
    ('schema = 2\n[run]\nname = "r"', "m.toml: unsupported manifest schema 2 (this peertrain "
                                      "reads 1)"),
    ('schema = 0\nbogus = 1', "m.toml: unsupported manifest schema 0 (this peertrain reads 1)"),
    ('schema = "1"\n[run]\nname = "r"', 'm.toml: schema: must be an integer (got "1", a string)'),
    ('schema = true\n[run]\nname = "r"', "m.toml: schema: must be an integer (got true, a "
                                         "boolean)"),
])
def test_manifest_level_errors(toml, expected):
    assert error_of(toml + "\n") == expected


def test_odd_keys_stay_on_one_short_line():
    message = error_of(MINIMAL + '[model]\n"a\\nb" = 1\n"' + "k" * 500 + '" = 2\n')
    lines = message.splitlines()
    assert lines[0] == "m.toml: model.\"a\\nb\": unknown field 'a\\nb' in [model]"
    assert lines[1].startswith('m.toml: model."kkkk') and len(lines[1]) < 160
    assert len(lines) == 2


def test_several_problems_one_per_line_in_schema_order():
    message = error_of('[run]\nname = "a b"\n[model]\nd_model = 0\n[train]\nlr = 2\n'
                       "[outer]\ninner_steps = -1\n")
    assert message.splitlines() == [
        "m.toml: run.name: may use only letters, digits, '.', '_' and '-' (got \"a b\")",
        "m.toml: model.d_model: must be >= 1 (got 0)",
        "m.toml: train.lr: must be <= 1 (got 2)",
        "m.toml: outer.inner_steps: must be >= 1 (got -1)",
    ]


def test_many_problems_are_capped():
    admins = ", ".join(f'"bad{i}"' for i in range(40))
    lines = error_of(MINIMAL + f"[network]\nadmins = [{admins}]\n").splitlines()
    assert len(lines) == mf.MAX_ERRORS + 1
    assert lines[-1] == "m.toml: ... and 20 more problems"


@pytest.mark.parametrize(("text", "expected"), [
    ('[run]\nname = "r"\nseed = \n', "m.toml: invalid TOML: Invalid value (at line 3, column 8)"),
    ('[run]\nname = "r"\n[run]\n', "m.toml: invalid TOML: Cannot declare ('run',) twice "
                                   "(at line 3, column 5)"),
    ('[run]\nname = "r\n', "m.toml: invalid TOML: Illegal character '\\n' (at line 2, "
                           "column 10)"),
    ("a = " + "[" * 5000 + "]" * 5000, "m.toml: invalid TOML: arrays or tables nested too deeply"),
    ('[run]\nname = "r"\nseed = ' + "9" * 5000,
     "m.toml: invalid TOML: Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_invalid_toml_reports_where(text, expected):
    assert error_of(text) == expected


def test_non_utf8_and_bad_unicode():
    assert error_of(b'[run]\nname = "\xff"\n') == (
        "m.toml: not UTF-8 text (invalid start byte at line 2, column 9)")
    assert error_of('[run]\nname = "r"\ndescription = "\ud800"\n') == (
        "m.toml: not valid Unicode text (surrogates not allowed at line 3, column 16)")


def test_oversized_manifest_is_refused_before_parsing():
    at_limit = MINIMAL + "#" * (mf.MAX_MANIFEST_BYTES - len(MINIMAL) - 1) + "\n"
    assert len(at_limit.encode()) == mf.MAX_MANIFEST_BYTES
    assert mf.parse_manifest(at_limit).run.name == "r"
    # Not TOML at all: the size check must come first.
    too_big = b"\xff" * (mf.MAX_MANIFEST_BYTES + 1)
    assert error_of(too_big) == ("m.toml: too large: a manifest is at most 65536 bytes "
                                 "(got 65537 bytes)")
    assert "too large" in error_of("é" * (mf.MAX_MANIFEST_BYTES // 2 + 1))  # bytes, not chars
    assert "too large" in error_of("x" * (mf.MAX_MANIFEST_BYTES + 1))


def test_load_manifest_file_names_the_path_and_reads_no_more_than_the_limit(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL + "[outer]\ninner_steps = 0\n")
    with pytest.raises(mf.ManifestError) as info:
        mf.load_manifest_file(bad)
    assert str(info.value) == f"{bad}: outer.inner_steps: must be >= 1 (got 0)"
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (10 * mf.MAX_MANIFEST_BYTES))
    with pytest.raises(mf.ManifestError, match=r"too large: .* \(got at least 65537 bytes\)"):
        mf.load_manifest_file(huge)
    with pytest.raises(FileNotFoundError):
        mf.load_manifest_file(tmp_path / "missing.toml")


# -- parse_canonical: what a joiner does with bytes from a stranger ----------------------


def canonical_default() -> tuple[mf.Manifest, bytes, str]:
    m = mf.load_manifest_file(DEFAULT)
    data = mf.canonical_bytes(m)
    return m, data, mf.run_id(data)


def test_parse_canonical_round_trips():
    m, data, run = canonical_default()
    assert mf.parse_canonical(data, expected_run_id=run) == m
    assert mf.parse_canonical(data) == m
    assert mf.parse_canonical(bytearray(data), run) == m
    assert mf.parse_canonical(memoryview(data), run) == m


def test_parse_canonical_rejects_every_tampered_byte():
    _, data, run = canonical_default()
    for i in range(0, len(data), 7):
        tampered = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        with pytest.raises(mf.ManifestMismatch):
            mf.parse_canonical(tampered, expected_run_id=run)


def test_parse_canonical_mismatch_names_both_ids_before_parsing():
    _, data, _ = canonical_default()
    other = mf.run_id(b"another run")
    for payload in (data, b"\xff not even utf-8", b"[" * 1000):
        with pytest.raises(mf.ManifestMismatch) as info:
            mf.parse_canonical(payload, expected_run_id=other)
        message = str(info.value)
        assert other in message and mf.run_id(payload) in message
    assert str(info.value) == (f"manifest of run {other}: the bytes hash to run-id "
                               f"{mf.run_id(b'[' * 1000)}, not to {other}")


def non_canonical_variants(data: bytes) -> dict[str, bytes]:
    doc = json.loads(data)
    without_aggregate = {k: v for k, v in doc.items() if k != "aggregate"}
    int_lr = json.loads(data)
    int_lr["train"]["lr"] = 1
    dumps = json.dumps
    return {
        "pretty": dumps(doc, sort_keys=True, indent=1).encode(),
        "spaces": dumps(doc, sort_keys=True).encode(),
        "unsorted": dumps(dict(reversed(doc.items())), separators=(",", ":")).encode(),
        "ascii-escaped": dumps({**doc, "run": {**doc["run"], "description": "é"}},
                               sort_keys=True, separators=(",", ":")).encode(),
        "default-left-out": dumps(without_aggregate, sort_keys=True,
                                  separators=(",", ":")).encode(),
        "int-for-float": dumps(int_lr, sort_keys=True, separators=(",", ":")).encode(),
        "duplicate-key": data[:-1] + b',"schema":1}',
        "trailing-newline": data + b"\n",
        "bom": b"\xef\xbb\xbf" + data,
    }


@pytest.mark.parametrize("variant", list(non_canonical_variants(canonical_default()[1])))
def test_parse_canonical_rejects_non_canonical_json(variant):
    data = non_canonical_variants(canonical_default()[1])[variant]
    # Even when the id matches (a peer that made the id from these very bytes), refuse:
    # the same run must never have two ids.
    with pytest.raises(mf.ManifestError) as info:
        mf.parse_canonical(data, expected_run_id=mf.run_id(data))
    assert not isinstance(info.value, mf.ManifestMismatch)
    message = str(info.value)
    assert message.startswith(f"manifest of run {mf.run_id(data)}: ")
    assert "not in canonical form" in message or "not JSON" in message, message


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "not JSON: Expecting value"),
    (b"\xff", "not UTF-8 (invalid start byte at byte 0)"),
    (b"[]", "a manifest is a table of sections (got an array)"),
    (b'"x"', "a manifest is a table of sections (got a string)"),
    (b"[" * 30000 + b"]" * 30000, "JSON nested too deeply"),
    (b'{"schema":2}', "unsupported manifest schema 2 (this peertrain reads 1)"),
    (b'{"run":{"name":"r"},"model":{"d_model":1e999}}', "model.d_model: must be an integer"),
    (b'{"run":{"name":"r"},"train":{"lr":NaN}}', "train.lr: must be a finite number (got nan)"),
    (b'{"run":{"name":"r"},"evil":1}', "evil: unknown field 'evil' at the top level"),
    (b'{"schema":1,"run":{"name":"r","seed":' + b"9" * 5000 + b"}}", "not JSON: Exceeds the"),
    (b"x" * (mf.MAX_MANIFEST_BYTES + 1), "too large: a manifest is at most 65536 bytes"),
])
def test_parse_canonical_rejects_garbage_with_a_reason(data, reason):
    with pytest.raises(mf.ManifestError) as info:
        mf.parse_canonical(data)
    assert str(info.value).startswith("canonical manifest: ")
    assert reason in str(info.value)


def test_parse_canonical_source_names_the_peer():
    with pytest.raises(mf.ManifestError, match=r"^peer X: a manifest is a table"):
        mf.parse_canonical(b"[]", source="peer X")


# -- run-ids typed by people -----------------------------------------------------------------


def test_validate_run_id_accepts_real_ids():
    _, _, run = canonical_default()
    assert mf.validate_run_id(run) == run
    assert mf.validate_run_id(f"  {run}\n") == run  # pasted with whitespace


@pytest.mark.parametrize(("text", "reason"), [
    ("", "expected 46 base58 characters"),
    ("not-a-run-id", "expected 46 base58 characters"),
    ("QmTdidegK6mspDJn9YVtK8UDxRchER9Lqi5H187RnViwa", "expected 46"),    # one short
    ("QmTdidegK6mspDJn9YVtK8UDxRchER9Lqi5H187RnViwaT1", "expected 46"),  # one long
    ("QmTdidegK6mspDJn9YVtK8UDxRchER9Lqi5H187RnViwa0", "expected 46"),   # 0 is not base58
    ("QmTdidegK6mspDJn9YVtK8UDxRchER9Lqi5H187RnViw T", "expected 46"),
    (PEER, "(that looks like a peer id)"),
    (base58.b58encode(b"\x13\x20" + bytes(32)).decode(), "is not a sha2-256 multihash"),
    (base58.b58encode(b"\x12\x21" + bytes(32)).decode(), "is not a sha2-256 multihash"),
    ("1" * 46, "is not a sha2-256 multihash"),
    ("bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdi", "expected 46"),
])
def test_validate_run_id_refuses_with_a_reason(text, reason):
    with pytest.raises(mf.ManifestError) as info:
        mf.validate_run_id(text)
    assert str(info.value).startswith("not a peertrain run-id: ")
    assert reason in str(info.value)


def test_validate_run_id_refuses_non_strings():
    with pytest.raises(mf.ManifestError, match="expected a string, got an integer"):
        mf.validate_run_id(42)  # type: ignore[arg-type]


# -- properties: random valid manifests, and garbage ---------------------------------------

_floats = dict(allow_nan=False, allow_infinity=False)
_name = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1,
                max_size=64)
_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: s not in {"if", "in", "is", "or", "as", "def", "for", "and", "not", "try", "del"})
_factory = st.one_of(st.just(""), st.builds(
    lambda mod, attr: ".".join(mod) + ":" + ".".join(attr),
    st.lists(_ident, min_size=1, max_size=3), st.lists(_ident, min_size=1, max_size=2)))
_peer = st.text("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz", min_size=46,
                max_size=60)
_addr = st.builds(lambda ip, port, peer: f"/ip4/{ip}/tcp/{port}/p2p/{peer}",
                  st.ip_addresses(v=4), st.integers(1, 65535), _peer)


def optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A table where each field may be left out (then its default applies)."""
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def model_tables(draw) -> dict:
    table = draw(optional(task=st.sampled_from(["bytes-gpt", "digits-mlp"]), factory=_factory,
                          n_layers=st.integers(1, 512), context=st.integers(1, 65536)))
    heads = draw(st.one_of(st.none(), st.integers(1, 64)))
    if heads is not None:  # d_model a multiple of n_heads, both within bounds
        table["n_heads"] = heads
        table["d_model"] = heads * draw(st.integers(1, 16384 // heads))
    elif draw(st.booleans()):
        table["d_model"] = 4 * draw(st.integers(1, 4096))  # the default n_heads is 4
    return table


@st.composite
def data_tables(draw) -> dict:
    table = draw(optional(
        source=st.sampled_from(["stdlib", "digits", "files"]),
        format=st.sampled_from(["text", "jsonl"]),
        jsonl_field=st.text(min_size=1, max_size=20),
        val_fraction=st.floats(0, 0.5, exclude_min=True, exclude_max=True, **_floats),
        label_skew=st.floats(0, 1000, **_floats)))
    if table.get("source") == "files" or draw(st.booleans()):
        table["paths"] = draw(st.lists(st.text(min_size=1, max_size=30),
                                       min_size=1 if table.get("source") == "files" else 0,
                                       max_size=4))
    return table


_raw_manifests = st.fixed_dictionaries(
    {"run": st.fixed_dictionaries({"name": _name}, optional={
        "description": st.text(max_size=200), "seed": st.integers(0, 2**63 - 1)})},
    optional={
        "schema": st.just(1),
        "model": model_tables(),
        "data": data_tables(),
        "train": optional(
            batch_size=st.integers(1, 65536),
            lr=st.floats(0, 1, exclude_min=True, **_floats),
            warmup_steps=st.integers(0, 2**31 - 1),
            total_steps=st.integers(1, 2**40 - 1),
            weight_decay=st.floats(0, 10, **_floats),
            grad_clip=st.floats(0, 1e6, **_floats),
            eval_every=st.integers(1, 2**31 - 1),
            eval_batches=st.integers(1, 10_000),
            threads=st.integers(1, 1024)),
        "outer": optional(
            algorithm=st.sampled_from(["noloco", "gossip", "diloco", "none"]),
            inner_steps=st.integers(1, 2**31 - 1),
            outer_lr=st.floats(0, 10, exclude_min=True, **_floats),
            momentum=st.floats(0, 1, exclude_max=True, **_floats),
            nesterov=st.booleans(),
            group_size=st.integers(2, 1024),
            codec=st.sampled_from(["fp32", "bf16", "int8"])),
        "aggregate": optional(
            method=st.sampled_from(["mean", "vc", "sybilwall", "median", "krum", "foolsgold"]),
            neighbours=st.integers(1, 1024)),
        "checkpoint": optional(every_steps=st.integers(1, 2**31 - 1),
                               keep=st.integers(1, 1000)),
        "network": optional(bootstrap=st.lists(_addr, max_size=3),
                            admins=st.lists(_peer, max_size=3)),
    })


def _gossip_if_aggregating(doc: dict) -> dict:
    """An aggregator other than the mean is only valid with gossip learning."""
    if doc.get("aggregate", {}).get("method", "mean") != "mean":
        doc["outer"] = {**doc.get("outer", {}), "algorithm": "gossip"}
    return doc


manifests = _raw_manifests.map(_gossip_if_aggregating)


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: escape quotes, backslash, every control
        return '"' + "".join(
            f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
            for c in v) + '"'
    assert isinstance(v, list)
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


def to_toml(doc: dict, rng: random.Random | None = None) -> str:
    """Write a manifest dict as TOML; with `rng`, in a shuffled order with comments."""
    def order(items):
        items = list(items)
        if rng:
            rng.shuffle(items)
        return items

    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, table in order((k, v) for k, v in doc.items() if isinstance(v, dict)):
        lines.append(f"\n[{section}]" + ("  # a comment" if rng else ""))
        lines += [f"{k} = {toml_value(v)}" for k, v in order(table.items())]
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None)
@given(manifests, st.randoms(use_true_random=False))
def test_random_valid_manifests_round_trip_and_ids_are_deterministic(doc, rng):
    m = mf.parse_manifest(to_toml(doc))
    assert m == mf.Manifest.model_validate(doc)
    data = mf.canonical_bytes(m)
    run = mf.run_id(data)
    assert mf.parse_canonical(data, expected_run_id=run) == m
    assert mf.canonical_bytes(mf.parse_canonical(data)) == data
    # Written in another order, with comments: the same run.
    assert mf.run_id(mf.canonical_bytes(mf.parse_manifest(to_toml(doc, rng)))) == run
    assert mf.validate_run_id(run) == run


@settings(max_examples=100, deadline=None)
@given(manifests, st.data())
def test_changing_one_value_changes_the_id(doc, data):
    m = mf.parse_manifest(to_toml(doc))
    section = data.draw(st.sampled_from(["run", "train", "outer", "checkpoint"]))
    current = getattr(m, section)
    field = data.draw(st.sampled_from(sorted(type(current).model_fields)))
    value = getattr(current, field)
    if isinstance(value, bool):
        new = not value
    elif isinstance(value, int):
        new = value + 1 if value < 1000 else value - 1
    elif isinstance(value, float):
        new = value / 2 if value > 1e-300 else value + 0.25
    else:
        new = value + "x" if len(value) < 60 else value[:-1]
    if isinstance(value, str) and field == "algorithm":
        new = "gossip" if value != "gossip" else "noloco"
        if m.aggregate.method != "mean":  # the aggregators need gossip learning
            return
    if isinstance(value, str) and field == "codec":
        new = "fp32" if value != "fp32" else "int8"
    if isinstance(value, str) and field == "compile":
        new = "off" if value != "off" else "on"
    changed = {**m.model_dump(by_alias=True),
               section: {**current.model_dump(), field: new}}
    other = mf.Manifest.model_validate(changed)
    assert other != m
    assert rid(other) != rid(m)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=2000), st.text(max_size=2000).map(str.encode)))
def test_garbage_gives_manifest_error_or_a_manifest(data):
    """h11's invariant: any bytes yield a result or the module's own error, nothing else."""
    for parse in (mf.parse_manifest, mf.parse_canonical):
        with contextlib.suppress(mf.ManifestError):
            parse(data)


@settings(max_examples=200, deadline=None)
@given(manifests, st.data())
def test_mutated_manifests_give_manifest_error_or_a_manifest(doc, data):
    """Valid TOML with a random edit: a wrong type, a stray key, a deleted character."""
    text = to_toml(doc)
    i = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.sampled_from(['"', "[", "]", "=", "\n", "x = 1\n", "true", "-", "9e9",
                                      "\\", "\x00", "é"]))
    for variant in (text[:i] + junk + text[i:], text[:i] + text[i + 1:]):
        try:
            mf.parse_manifest(variant)
        except mf.ManifestError as e:
            assert str(e).startswith("<manifest>: ")


def test_an_aggregator_other_than_mean_needs_gossip_learning():
    message = error_of(MINIMAL + '[aggregate]\nmethod = "sybilwall"\n')
    assert 'aggregate.method = "sybilwall" needs outer.algorithm = "gossip"' in message
    m = mf.parse_manifest(MINIMAL + '[outer]\nalgorithm = "gossip"\n[aggregate]\nmethod = "vc"\n')
    assert (m.outer.algorithm, m.aggregate.method) == ("gossip", "vc")
