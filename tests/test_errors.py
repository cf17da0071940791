"""Error handling: malformed checkpoints raise CheckpointError naming the file (and tensor),
bad arguments raise ValueError naming what is wrong, and a failed call leaves the model and
its sequences untouched and usable.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import diffuserve as ds
from diffuserve import _core
from diffuserve.random_checkpoint import write_random_checkpoint
from diffuserve.safetensors_io import write_safetensors

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
            num_experts=4, top_k_experts=2, moe_intermediate_size=16)
CANVAS, VOCAB = 8, 64
PROMPT = [2, 5, 7, 11, 13]
NORM = "model.decoder.norm.weight"  # shape [32], F32: 128 bytes
SC_NORM = "model.decoder.self_conditioning.pre_norm.weight"  # same shape as NORM
ROUTER = "model.decoder.layers.1.router.proj.weight"  # shape [4, 32]


@pytest.fixture(scope="session")
def valid_dir(tmp_path_factory):
    """A valid tiny checkpoint; tests that corrupt one work on a copy (see `ckpt`)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("valid") / "m", canvas_length=CANVAS, **TINY)


@pytest.fixture
def ckpt(valid_dir, tmp_path):
    """A private copy of the valid checkpoint, free to corrupt."""
    return shutil.copytree(valid_dir, tmp_path / "m")


@pytest.fixture(scope="session")
def model(valid_dir):
    return ds.Model.load(valid_dir)


@pytest.fixture
def seq(model):
    """A sequence with PROMPT prefilled."""
    s = model.sequence()
    s.prefill(PROMPT)
    return s


def load_fails(path, *fragments):
    """Model.load(path) raises CheckpointError whose message holds every fragment."""
    with pytest.raises(ds.CheckpointError, match=re.escape(fragments[0])) as info:
        ds.Model.load(path)
    for fragment in fragments[1:]:
        assert fragment in str(info.value)


def read_safetensors(path):
    """(header dict, data section bytes) of a .safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def pack(header, data=b""):
    """Safetensors bytes from a header (dict, or raw bytes used verbatim) and a data section."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def logits_of(m):
    s = m.sequence()
    s.prefill(PROMPT)
    return s.denoise(np.arange(CANVAS))


def state_of(s):
    """len(s) and a copy of every layer's KV cache."""
    return len(s), [s.kv(i) for i in range(TINY["num_hidden_layers"])]


def assert_intact(s, before):
    """A failed call left `s` as it was, and it still prefills and denoises."""
    length, kv = state_of(s)
    assert length == before[0]
    for (k0, v0, p0), (k1, v1, p1) in zip(before[1], kv):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
        assert p0 == p1
    if length == 0:
        s.prefill(PROMPT)
    logits = s.denoise(np.arange(CANVAS))
    assert logits.shape == (CANVAS, VOCAB) and np.isfinite(logits).all()
    s.prefill([3, 4])
    assert len(s) == max(length, len(PROMPT)) + 2


# --- the safetensors file itself -------------------------------------------------------------

def entry(header, name, **fields):
    """The header with fields of tensor `name`'s entry replaced."""
    return {**header, name: {**header[name], **fields}}


def repeated(header, name, entry_of):
    """The header's JSON with `name` written a second time, last, with tensor `entry_of`'s entry."""
    return (json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[entry_of])}}}").encode()


BAD_FILES = {
    "header length past end of file": (lambda h, d: struct.pack("<Q", len(pack(h, d))) + pack(h, d)[8:],
                                       ["bad header length"]),
    "header length 2**62": (lambda h, d: struct.pack("<Q", 2**62) + pack(h, d)[8:], ["bad header length"]),
    "shorter than 8 bytes": (lambda h, d: b"\x10\x00\x00", ["too short"]),
    "empty file": (lambda h, d: b"", ["0 bytes", "too short"]),
    "header not JSON": (lambda h, d: pack(b'{"a": [1, 2', d), ["header", "invalid JSON"]),
    "header not an object": (lambda h, d: pack(b"[1, 2, 3]", d), ["header is not a JSON object"]),
    "unknown dtype": (lambda h, d: pack(entry(h, NORM, dtype="F99"), d), ["unknown dtype 'F99'", NORM]),
    "data_offsets out of range": (lambda h, d: pack(entry(h, NORM, data_offsets=[len(d), len(d) + 128]), d),
                                  ["out of range", NORM]),
    "overlapping data_offsets": (lambda h, d: pack(entry(h, SC_NORM, data_offsets=h[NORM]["data_offsets"]), d),
                                 ["overlap", NORM, SC_NORM]),
    "shape vs byte count": (lambda h, d: pack(entry(h, NORM, shape=[33]), d),
                            ["needs 132 bytes but data_offsets give 128", NORM]),
    "negative shape": (lambda h, d: pack(entry(h, NORM, shape=[-32]), d), ["non-negative integers", NORM]),
    "fractional shape": (lambda h, d: pack(entry(h, NORM, shape=[32.5]), d), ["non-negative integers", NORM]),
    # No bytes, but dimensions whose element count overflows int64 before the zero (undefined
    # behaviour in every count of its elements, UBSan's report).
    "empty tensor of 2^63 elements and a zero": (
        lambda h, d: pack({**entry(h, NORM, dtype="U8", shape=[2**32, 2**31, 0],
                                   data_offsets=h[NORM]["data_offsets"][:1] * 2),
                           "pad": {"dtype": "U8", "shape": [128], "data_offsets": h[NORM]["data_offsets"]}}, d),
        ["nonzero dimensions' product passes 2^63", NORM]),
    "string shape": (lambda h, d: pack(entry(h, NORM, shape=["32"]), d), ["non-negative integers", NORM]),
    "a tensor's entry missing": (lambda h, d: pack({k: v for k, v in h.items() if k != NORM}, d),
                                 ["belong to no tensor", "a header entry missing"]),
    "bytes after the last tensor": (lambda h, d: pack(h, d + bytes(8)), ["at its end belong to no tensor"]),
    "a tensor named twice": (lambda h, d: pack(repeated(h, NORM, SC_NORM), d), ["overlap", NORM, SC_NORM]),
    "data_offsets begin > end": (lambda h, d: pack(entry(h, NORM, data_offsets=h[NORM]["data_offsets"][::-1]), d),
                                 ["end before they begin", NORM]),
    **{f"missing {key}": (lambda h, d, key=key: pack({**h, NORM: {k: v for k, v in h[NORM].items() if k != key}}, d),
                          [f'"{key}"', NORM])
       for key in ["dtype", "shape", "data_offsets"]},
    "shape not an array": (lambda h, d: pack(entry(h, NORM, shape={"0": 32}), d), ["non-array \"shape\"", NORM]),
    "three data_offsets": (lambda h, d: pack(entry(h, NORM, data_offsets=h[NORM]["data_offsets"] + [0]), d),
                           ["\"data_offsets\" must be two non-negative integers", NORM]),
    "an entry that is an array": (lambda h, d: pack({**h, NORM: [0] * 1000}, d), ["header entry is not a JSON object"]),
    "metadata not an object": (lambda h, d: pack({"__metadata__": ["x"], **h}, d), ["__metadata__ is not a JSON object"]),
    "metadata not strings": (lambda h, d: pack({"__metadata__": {"format": "pt", "n": 1}, **h}, d),
                             ["__metadata__ value for 'n' is not a string"]),
    "header nested past 256 levels": (lambda h, d: pack(b'{"x": ' + b"[" * 300 + b"]" * 300 + b"}", d),
                                      ["header: invalid JSON at byte 261", "nesting deeper than 256"]),
    # A syntax error is told as one, however the entries before it read.
    "a bad entry, then no JSON": (lambda h, d: pack(b'{"a": 5, "b": {"dtype": "F32",', d),
                                  ["header: invalid JSON at byte 32: expected a string key"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_corrupt_safetensors(ckpt, case):
    """Each kind of malformed model.safetensors is refused, naming the file and the problem."""
    corrupt, fragments = BAD_FILES[case]
    path = ckpt / "model.safetensors"
    path.write_bytes(corrupt(*read_safetensors(path)))
    load_fails(ckpt, str(path), *fragments)


def test_a_config_larger_than_its_tensors_is_refused_before_it_allocates(ckpt):
    """Head counts and dims far past the stored weights' are a shape error naming the tensor:
    the stacked q/k/v buffer had been allocated from the config first (terabytes: out of
    memory, blaming the weights or the KV cache)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"].update(num_attention_heads=4096, head_dim=1 << 20)
    (ckpt / "config.json").write_text(json.dumps(config))
    load_fails(ckpt, "q_proj.weight")


def test_a_repeated_identical_entry_loads(ckpt):
    """A header naming a tensor twice with the same entry leaves no byte unclaimed: it loads,
    as safetensors' own reader loads it."""
    path = ckpt / "model.safetensors"
    header, data = read_safetensors(path)
    path.write_bytes(pack(repeated(header, NORM, NORM), data))
    ds.Model.load(str(ckpt))


def test_an_entrys_unknown_fields_are_passed_over_and_a_repeated_fields_last_counts(ckpt, model):
    """An entry's fields in any order, one given twice (the last counts, as json.loads reads
    it), one that is not safetensors' (passed over, as safetensors' own reader does): the
    checkpoint loads and computes what it did."""
    path = ckpt / "model.safetensors"
    header, data = read_safetensors(path)
    norm = header.pop(NORM)
    body = json.dumps(header)[:-1] + (f', {json.dumps(NORM)}: {{"extra": {{"x": [1, [2, {{}}]]}}, "dtype": "F99", '
                                      f'"data_offsets": {norm["data_offsets"]}, "shape": [1], "dtype": "F32", '
                                      f'"shape": {norm["shape"]}}}}}')
    path.write_bytes(pack(body.encode(), data))
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))


def test_a_large_header_is_read_without_holding_it_as_json_values(ckpt):
    """A 24 MB header, an array of 12 million zeros where an entry belongs, is refused in about
    the memory its file takes: parsed whole into JSON values it had taken gigabytes (9 GB for
    safetensors' largest header, 100 MB), enough for the kernel to end the process."""
    path = ckpt / "model.safetensors"
    header, data = read_safetensors(path)
    zeros = b"[" + b"0," * 12_000_000 + b"0]"
    path.write_bytes(pack(json.dumps(header)[:-1].encode() + b', "zeros": ' + zeros + b"}", data))
    message, grown_mb = load_in_subprocess(ckpt)
    assert "tensor 'zeros': header entry is not a JSON object" in message
    assert grown_mb < 200, f"the peak resident memory grew {grown_mb} MB"


def load_in_subprocess(ckpt):
    """(what Model.load(ckpt) says: its CheckpointError's message or "loaded", by how many MB
    its peak resident memory grew), from a fresh process."""
    script = ("import resource, sys, diffuserve as ds\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "try:\n    ds.Model.load(sys.argv[1])\n    print('loaded')\n"
              "except ds.CheckpointError as e:\n    print(e)\n"
              "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    out = subprocess.run([sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    message, grown_mb = out.stdout.strip().rsplit("\n", 1)
    return message, int(grown_mb)


def test_truncated_data_section(ckpt):
    """Bytes cut off the end: the last tensor no longer fits, and the message says truncated."""
    path = ckpt / "model.safetensors"
    header, data = read_safetensors(path)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    path.write_bytes(pack(header, data[:-4]))
    load_fails(ckpt, "truncated", str(path), last)


# --- sharded checkpoints ----------------------------------------------------------------------

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def shard(ckpt):
    """Splits model.safetensors into SHARDS plus an index; returns the index's weight_map."""
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    weight_map = {name: SHARDS[i * 2 // len(names)] for i, name in enumerate(names)}
    for file in SHARDS:
        write_safetensors(ckpt / file, {n: tensors[n] for n in names if weight_map[n] == file})
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_checkpoint_matches_single_file(ckpt, model):
    """A valid two-shard checkpoint loads and gives the single file's logits exactly."""
    shard(ckpt)
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))


def test_a_large_index_is_read_without_holding_it_as_json_values(ckpt, model):
    """An index whose metadata holds 12 million zeros (24 MB) loads in about the memory its file
    takes, its weight_map read an entry at a time: parsed whole it had grown the process by
    over 2 GB."""
    weight_map = shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    zeros = "[" + "0," * 12_000_000 + "0]"
    index.write_text('{"metadata": {"zeros": ' + zeros + '}, "weight_map": ' + json.dumps(weight_map) + "}")
    message, grown_mb = load_in_subprocess(ckpt)
    assert message == "loaded"
    assert grown_mb < 200, f"the peak resident memory grew {grown_mb} MB"
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))


def test_index_repeats_are_read_as_json_reads_them(ckpt, model):
    """A repeated weight_map, or a tensor named twice in one, counts its last entry, as Python's
    json (and so transformers) reads it; an entry that is not a string is named."""
    weight_map = shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    wrong = {name: SHARDS[0] if file == SHARDS[1] else SHARDS[1] for name, file in weight_map.items()}
    body = json.dumps(weight_map)[:-1] + f", {json.dumps(ROUTER)}: {json.dumps(weight_map[ROUTER])}}}"
    index.write_text('{"weight_map": ' + json.dumps(wrong) + ', "weight_map": ' + body + "}")
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))
    # An earlier value that is not an object, or an entry that is not a string, given again
    # right: the last counts.
    index.write_text('{"weight_map": 5, "weight_map": ' + body + "}")
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))
    index.write_text('{"weight_map": {' + f"{json.dumps(ROUTER)}: 7, " + json.dumps(weight_map)[1:] + "}")
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))
    index.write_text('{"weight_map": ' + json.dumps({**weight_map, ROUTER: 7}) + "}")
    load_fails(ckpt, f"weight_map entry for tensor '{ROUTER}' is not a string", str(index))
    index.write_text('{"weight_map": ' + json.dumps(weight_map) + ', "weight_map": null}')
    load_fails(ckpt, '"weight_map" is not a JSON object', str(index))
    index.write_text('{"weight_map": [], "metadata": {}}')
    load_fails(ckpt, '"weight_map" is not a JSON object', str(index))
    index.write_text('{"weight_map": {"a": 1}, "metadata": {]}')  # syntax first, wherever it is
    load_fails(ckpt, "invalid JSON", str(index))


@pytest.mark.parametrize("name, limit", [("config.json", 16_000_000), ("generation_config.json", 16_000_000),
                                         ("model.safetensors.index.json", 64_000_000)])
def test_oversized_json_files_are_refused_before_they_are_read(ckpt, name, limit):
    """A JSON file past its limit (each far above any real one's size) is refused by its size,
    before its bytes are read or parsed: a huge one could otherwise take the host's memory."""
    if name.endswith("index.json"):
        shard(ckpt)
    path = ckpt / name
    text = path.read_text() if path.exists() else "{}"
    path.write_text(text + " " * (limit + 1 - len(text.encode())))
    load_fails(ckpt, f"{limit + 1} bytes, over the limit of {limit}", str(path))
    path.write_text(text + " " * (limit - len(text.encode())))  # at the limit it is read
    ds.Model.load(ckpt)


def test_index_invalid_json(ckpt):
    shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    index.write_text('{"weight_map": {')
    load_fails(ckpt, "invalid JSON", str(index))


def test_index_without_weight_map(ckpt):
    shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    index.write_text('{"metadata": {}}')
    load_fails(ckpt, "weight_map", str(index))


def test_index_names_missing_shard(ckpt):
    weight_map = shard(ckpt)
    weight_map[ROUTER] = "model-00003-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_fails(ckpt, "model-00003-of-00002.safetensors", "cannot open")


def test_index_lists_tensor_not_in_its_shard(ckpt):
    weight_map = shard(ckpt)
    weight_map[ROUTER] = next(f for f in SHARDS if f != weight_map[ROUTER])
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_fails(ckpt, ROUTER, "does not contain", "model.safetensors.index.json")


def test_index_shard_path_escaping_directory(ckpt):
    """'../x.safetensors' is refused even though that file exists and is valid."""
    weight_map = shard(ckpt)
    escaped = weight_map[ROUTER]
    shutil.copy(ckpt / escaped, ckpt.parent / "x.safetensors")
    weight_map = {name: "../x.safetensors" if file == escaped else file for name, file in weight_map.items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_fails(ckpt, "'../x.safetensors'", "not a file inside")


def test_index_names_one_shard_two_ways(ckpt, model):
    """Entries naming a shard as "./shard" and as "shard" name one file, as transformers reads
    them (it had been opened twice, each tensor then "stored in both")."""
    weight_map = shard(ckpt)
    aliased = {name: (f"./{f}" if i % 2 else f) for i, (name, f) in enumerate(weight_map.items())}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": aliased}))
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))


def test_index_shard_in_a_subdirectory(ckpt):
    """A shard under a subdirectory of the checkpoint loads, as transformers reads it (it had been
    refused); one through .. or by an absolute path does not."""
    weight_map = shard(ckpt)
    moved = weight_map[ROUTER]
    (ckpt / "sub").mkdir()
    shutil.move(ckpt / moved, ckpt / "sub" / moved)
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: f"sub/{f}" if f == moved else f for n, f in weight_map.items()}}))
    ds.Model.load(ckpt)
    for name in (f"sub/../sub/{moved}", str(ckpt / "sub" / moved)):
        index.write_text(json.dumps({"weight_map": {n: name if f == moved else f for n, f in weight_map.items()}}))
        load_fails(ckpt, f"'{name}'", "not a file inside")


# --- config.json ------------------------------------------------------------------------------

_DELETE = object()


def _set(cfg, dotted, value):
    """Sets (or, for _DELETE, removes) the dotted field of a config dict."""
    *parents, key = dotted.split(".")
    for p in parents:
        cfg = cfg[p]
    if value is _DELETE:
        del cfg[key]
    else:
        cfg[key] = value


BAD_CONFIGS = {
    "model_type": ("model_type", "gemma3", ["model_type 'gemma3' is not supported"]),
    "no text_config": ("text_config", _DELETE, ["text_config is missing"]),
    # (transformers has no default for the experts' sizes; for hidden_size and the like it has,
    # and so does this: test_config_defaults.)
    "no num_experts": ("text_config.num_experts", _DELETE, ["text_config.num_experts is missing"]),
    "string hidden_size": ("text_config.hidden_size", "32", ["text_config.hidden_size must be an integer"]),
    "layer_types length": ("text_config.layer_types", ["sliding_attention"] * 3, ["text_config.layer_types", "(2)"]),
    "rope_type": ("text_config.rope_parameters.full_attention.rope_type", "yarn",
                  ["rope_parameters.full_attention.rope_type", "'yarn' is not supported"]),
    "hidden_activation": ("text_config.hidden_activation", "relu", ["hidden_activation", "'relu' is not supported"]),
    "per-layer override": ("text_config.per_layer_config.1.sliding_window", 4,
                           ["per_layer_config.1.sliding_window", "not a supported per-layer override"]),
    "one layer overridden twice": ("text_config.per_layer_config.01", {"head_dim": 16},
                                   ["per_layer_config.1 names the same layer as per_layer_config.01"]),
    # (its bytes, negative as chars, had gone to std::isdigit, undefined for them)
    "non-ASCII layer key": ("text_config.per_layer_config.١", {"head_dim": 16},
                            ["per_layer_config.١ does not name a layer index below num_hidden_layers"]),
    "eos past 32 bits": ("text_config.eos_token_id", [1, 2**40],
                         ["text_config.eos_token_id = 1099511627776 is out of range"]),
    "string pad": ("text_config.pad_token_id", "0", ["text_config.pad_token_id must be an integer"]),
    # A double that is infinite as the float32 the runtime keeps (the logits had come out NaN).
    "softcap past float32": ("text_config.final_logit_softcapping", 1e300,
                             ["text_config.final_logit_softcapping = 1e+300 does not fit a 32-bit float"]),
    # transformers' config takes null, "vision" or "all" (this had been accepted).
    "bidirectional attention": ("text_config.use_bidirectional_attention", "text",
                                ["use_bidirectional_attention 'text' is not one of null, 'vision' or 'all'"]),
    # transformers' typed config refuses these as null (they had been read as absent: defaults).
    "null window": ("text_config.sliding_window", None,
                    ["text_config.sliding_window is null, which transformers' config refuses"]),
    "null eps": ("text_config.rms_norm_eps", None, ["text_config.rms_norm_eps is null"]),
    "null activation": ("text_config.hidden_activation", None, ["text_config.hidden_activation is null"]),
    "null tie": ("tie_word_embeddings", None, ["tie_word_embeddings is null, which transformers' config refuses"]),
    "softcap null": ("text_config.final_logit_softcapping", None,
                     ["text_config.final_logit_softcapping is null; give a number > 0"]),
    # transformers divides the logits by it: every logit 0 or NaN (0 had turned softcapping off).
    "softcap zero": ("text_config.final_logit_softcapping", 0,
                     ["text_config.final_logit_softcapping must be > 0 (transformers divides the logits by it)"]),
    # transformers fails on a RoPE dict without rope_theta when text_config has none to fill it
    # from (10000 had been assumed).
    "no rope_theta": ("text_config.rope_parameters.sliding_attention.rope_theta", _DELETE,
                      ["text_config.rope_parameters.sliding_attention.rope_theta is missing (and text_config gives "
                       "no rope_theta"]),
    # 0 is proportional RoPE without rotation; past 1 there is no such share of the head.
    "partial rotary past 1": ("text_config.rope_parameters.full_attention.partial_rotary_factor", 1.5,
                              ["rope_parameters.full_attention.partial_rotary_factor must be in [0, 1]"]),
    # The dtype transformers would load the weights in, where this engine has no such weights.
    "dtype float64": ("dtype", "float64", ["config.json: dtype 'float64' is not one this engine loads weights in"]),
    # The field that gave the odd value is named (it had been text_config.head_dim).
    "odd per-layer head_dim": ("text_config.per_layer_config.1", {"head_dim": 7},
                               ["text_config.per_layer_config.1.head_dim = 7 must be even for RoPE (layer 1)"]),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config(ckpt, case):
    """Each config.json problem is refused, naming config.json and the field."""
    field, value, fragments = BAD_CONFIGS[case]
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    _set(cfg, field, value)
    path.write_text(json.dumps(cfg))
    load_fails(ckpt, str(path), *fragments)


@pytest.mark.parametrize("override, shape", [({"head_dim": 18}, "head_dim 18 and 1 KV heads"),
                                             ({"num_key_value_heads": 2}, "head_dim 32 and 2 KV heads")])
def test_layers_of_one_type_shaped_unlike_each_other_are_refused(ckpt, override, shape):
    """transformers makes one RoPE a layer type and cannot build a model whose full (or
    sliding) layers differ in shape; such a config.json had been loaded and run, a model with
    no reference. (Checked before the weights, which here are of two layers.)"""
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"].update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                              per_layer_config={"1": {"head_dim": 32, **override}, "3": {"head_dim": 32}})
    path.write_text(json.dumps(cfg))
    load_fails(ckpt, str(path), f"text_config.per_layer_config gives layer 3 head_dim 32 and 1 KV heads, where layer 1, "
                                f"also full_attention, has {shape}: every layer of a type must have one shape")


def test_config_invalid_json(ckpt):
    path = ckpt / "config.json"
    path.write_text(path.read_text()[:-10])
    load_fails(ckpt, str(path), "invalid JSON")


@pytest.mark.parametrize("fields, message", [
    ({"eos_token_id": [1, 2**40]}, "eos_token_id = 1099511627776 is out of range"),
    ({"pad_token_id": 1.5}, "pad_token_id must be an integer"),
    ({"cache_implementation": "bogus"},
     "cache_implementation 'bogus' is not a KV cache transformers has (it refuses it too)"),
    ({"cache_implementation": "paged"}, "cache_implementation 'paged' is not a KV cache"),  # (generate's own, not its config's)
    ({"t_max": 1e300}, "t_max = 1e+300 does not fit a 32-bit float"),
    # Checked as the other integers (transformers too refuses 0; max_length had been ignored).
    ({"max_length": 0}, "max_length = 0 is out of range [1, 2147483647]"),
    ({"max_length": 64.5}, "max_length must be an integer"), ({"max_length": "64"}, "max_length must be an integer"),
    # Defaults no request could run with (each request had been refused, naming a SamplingParams
    # field its caller never set).
    ({"stability_threshold": 5000, "max_denoising_steps": 5000},
     "its defaults fail a request's checks: SamplingParams.stability_threshold 5000 with max_denoising_steps 5000"),
    ({"t_min": 0.0, "t_max": 1e-19}, "its defaults fail a request's checks: SamplingParams.t_max and t_min give a "
                                     "smallest temperature"),
    # Fields and samplers transformers refuses to load (they had been ignored: min_new_tokens did nothing).
    ({"min_new_tokens": 8}, "min_new_tokens is not a DiffusionGemma generation setting (transformers refuses it too)"),
    ({"temperature": 0.7}, "temperature is not a DiffusionGemma generation setting"),
    ({"sampler_config": {"entropy_bound": 0.1}}, "sampler_config._cls_name must be 'EntropyBoundSamplerConfig'"),
    ({"sampler_config": {"entropy_bound": 0.1, "_cls_name": "FooSamplerConfig"}},
     "sampler_config._cls_name must be 'EntropyBoundSamplerConfig' (the one sampler), got 'FooSamplerConfig'"),
    ({"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig"}}, "sampler_config.entropy_bound is missing"),
    ({"sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig", "foo": 1}},
     "sampler_config.foo is not a field of EntropyBoundSamplerConfig"),
])
def test_bad_generation_config(ckpt, fields, message):
    """Refused at load, naming the file, rather than failing every later request."""
    path = ckpt / "generation_config.json"
    path.write_text(json.dumps(fields))
    load_fails(ckpt, str(path), message)


def test_token_ids_no_token_has(ckpt):
    """EOS, pad and BOS ids outside the vocabulary load, as transformers loads and runs them
    (they had been refused as out of range): an EOS no token is ends nothing, and is left out of
    the generation defaults; a pad id is kept whatever it is (tokens_per_forward leaves it out)."""
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"].update(eos_token_id=[1, 500], pad_token_id=999, bos_token_id=-5)
    path.write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [500, 1, -1], "pad_token_id": 999,
                                                             "cache_implementation": "static"}))
    generation = ds.Model.load(ckpt).config["generation"]
    assert generation["eos_token_ids"] == [1] and generation["pad_token_id"] == 999


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_fifo_in_place_of_a_file(ckpt, name):
    """A named pipe is refused as not a regular file (opening it for reading had blocked the
    load until some writer came), in a subprocess so that a regression fails, not hangs."""
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    code = ("import diffuserve as ds\ntry:\n    ds.Model.load(%r)\nexcept ds.CheckpointError as e:\n    print(e)"
            % str(ckpt))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"{ckpt / name}: not a regular file" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_fifo_in_place_of_a_tokenizer_file(ckpt, name):
    """So are the tokenizer's files, which LLM reads (a FIFO there had blocked it)."""
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pathlib.Path(ds.__file__).parent / "sudoku_model" / file, ckpt / file)
    if (ckpt / name).exists():
        (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    code = ("import diffuserve as ds\ntry:\n    ds.LLM(%r)\nexcept ds.CheckpointError as e:\n    print(e)" % str(ckpt))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"{ckpt / name}: not a regular file" in result.stdout, result.stdout + result.stderr


def test_config_missing(ckpt):
    (ckpt / "config.json").unlink()
    load_fails(ckpt, str(ckpt / "config.json"), "cannot open")


# --- tensors against the config ---------------------------------------------------------------

def rewrite(ckpt, edit):
    """Reloads model.safetensors's tensors, applies edit(dict) and writes them back."""
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    write_safetensors(ckpt / "model.safetensors", tensors)


@pytest.mark.parametrize("value, says", [("abc", "DIFFUSERVE_NUM_THREADS='abc' is not a thread count"),
                                         ("-3", "DIFFUSERVE_NUM_THREADS='-3' is not a thread count"),
                                         ("1.5", "DIFFUSERVE_NUM_THREADS='1.5' is not a thread count"),
                                         ("2000", "DIFFUSERVE_NUM_THREADS 2000 is more than 1024")])
def test_a_bad_thread_count_in_the_environment_is_named(valid_dir, value, says):
    """DIFFUSERVE_NUM_THREADS is read strictly (abc and -3 had meant every hardware thread, and
    2000 was refused as "num_threads", which the caller had left at 0)."""
    code = "import sys, diffuserve as ds\ntry: ds.Model.load(sys.argv[1])\nexcept ValueError as e: print(e)"
    out = subprocess.run([sys.executable, "-c", code, str(valid_dir)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DIFFUSERVE_NUM_THREADS": value})
    assert says in out.stdout, out.stdout + out.stderr


def test_a_load_of_a_given_thread_count_runs_on_that_many(valid_dir):
    """num_threads reaches the load's own conversions: they had run on the process's pool of
    every CPU whatever was asked (seen here through that pool's reading of a bad
    DIFFUSERVE_NUM_THREADS, which a load of a given count then failed on)."""
    code = "import sys, diffuserve as ds\nds.Model.load(sys.argv[1], num_threads=1)\nprint('loaded')"
    out = subprocess.run([sys.executable, "-c", code, str(valid_dir)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DIFFUSERVE_NUM_THREADS": "abc"})
    assert out.stdout == "loaded\n", out.stderr


def test_the_default_thread_count_is_the_cpus_the_process_may_run_on(valid_dir):
    """Left at 0, the pool has a thread for each CPU of the process's affinity (a container's
    cpuset, taskset), not for each of the host's: on one CPU, no thread beside the caller's
    (a 128-thread host had run 128 threads on a 2-CPU container's CPUs)."""
    code = ("import os, sys, diffuserve as ds\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "before = len(os.listdir('/proc/self/task'))\nmodel = ds.Model.load(sys.argv[1])\n"
            "model.sequence().prefill([2, 3, 4])\nprint(len(os.listdir('/proc/self/task')) - before)")
    env = {key: value for key, value in os.environ.items() if key != "DIFFUSERVE_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code, str(valid_dir)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.stdout == "0\n", out.stdout + out.stderr


def _write_files(root, files: dict) -> None:
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)


@pytest.mark.parametrize("groups, files, limits", [
    # v1 in a container: the groups' paths are the host's, the mounts the container's own group.
    ("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
     {"memory/memory.limit_in_bytes": "1073741824\n", "cpu/cpu.cfs_quota_us": "150000\n",
      "cpu/cpu.cfs_period_us": "100000\n"}, (1 << 30, 1.5)),
    # v1 on the host: the tightest of the group and its ancestors; no limit written as the
    # largest page-aligned int64, and a quota of -1.
    ("4:memory:/a/b\n3:cpu:/a/b\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                     "memory/a/memory.limit_in_bytes": "3000000000\n",
                                     "memory/a/b/memory.limit_in_bytes": "5000000000\n",
                                     "cpu/a/b/cpu.cfs_quota_us": "-1\n", "cpu/a/b/cpu.cfs_period_us": "100000\n"},
     (3000000000, 0.0)),
    # v2: "max" is no limit; cpu.max is "QUOTA PERIOD".
    ("0::/k/pod\n", {"k/memory.max": "max\n", "k/pod/memory.max": "2147483648\n", "k/cpu.max": "max 100000\n",
                     "k/pod/cpu.max": "250000 100000\n"}, (2 << 30, 2.5)),
    ("0::/\n", {"memory.max": "max\n", "cpu.max": "max 100000\n"}, (0, 0.0)),
    # A hybrid host: v1's controllers, and v2's hierarchy (mounted at root/unified) without them.
    ("4:memory:/a\n1:cpu,cpuacct:/a\n0::/a\n", {"memory/a/memory.limit_in_bytes": "4096000000\n",
                                                "cpu,cpuacct/a/cpu.cfs_quota_us": "50000\n",
                                                "cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
                                                "unified/a/cgroup.procs": ""}, (4096000000, 0.5)),
    # Files that do not parse are skipped.
    ("0::/x\n", {"x/memory.max": "lots\n", "x/cpu.max": "1 2 3\n"}, (0, 0.0)),
], ids=["v1-container", "v1-ancestors", "v2", "v2-none", "v1-v2-hybrid", "v2-garbage"])
def test_container_limits_are_read_from_the_cgroup_files(tmp_path, groups, files, limits):
    """The memory limit and CPU quota of the process's control groups (docker -m / --cpus,
    Kubernetes' limits), which the CPU backend sizes its default KV cache and threads by."""
    _write_files(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(groups)
    assert _core.cgroup_limits(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == limits
    assert _core.cgroup_limits(str(tmp_path / "none"), str(tmp_path / "fs")) == (0, 0.0)


def _cgroup_v1(controller: str, settings: dict):
    """A cgroup-v1 group of `controller` with `settings` written, or None where this process
    cannot make one (not root, no v1 hierarchy): a child that writes its pid to `tasks` runs in it."""
    base = f"/sys/fs/cgroup/{controller}"
    if os.geteuid() != 0 or not os.path.isfile(f"{base}/tasks"):
        return None
    path = f"{base}/diffuserve-test-{os.getpid()}"
    try:
        os.mkdir(path)
        for name, value in settings.items():
            with open(f"{path}/{name}", "w") as f:
                f.write(value)
    except OSError:
        if os.path.isdir(path):
            os.rmdir(path)
        return None
    return path


def _run_in(group: str, code: str, *args) -> subprocess.CompletedProcess:
    def join():
        with open(f"{group}/tasks", "w") as f:
            f.write(str(os.getpid()))
    env = {key: value for key, value in os.environ.items() if key != "DIFFUSERVE_NUM_THREADS"}
    try:
        return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                              timeout=120, env=env, preexec_fn=join)
    finally:
        os.rmdir(group)


def test_a_containers_memory_limit_is_the_cpus_memory(valid_dir):
    """In a group of 1 GiB (docker -m 1g) the CPU backend has 1 GiB in all: a KV cache of 2 GiB
    is refused, naming it, and the default cache is a quarter of it (it had been sized from the
    host's memory, and the process killed as it filled)."""
    group = _cgroup_v1("memory", {"memory.limit_in_bytes": str(1 << 30)})
    if group is None:
        pytest.skip("cannot make a cgroup-v1 memory group here")
    code = ("import sys, diffuserve as ds\n"
            "try:\n    ds.Model.load(sys.argv[1], kv_cache_memory_bytes=2 << 30)\n"
            "except ValueError as e:\n    print(e)\n"
            "print(ds.LLM(sys.argv[1]).stats()['kv_blocks_total'], ds.LLM(sys.argv[1], "
            "kv_cache_memory_bytes=256 << 20).stats()['kv_blocks_total'])")
    out = _run_in(group, code, valid_dir)
    lines = out.stdout.splitlines()
    assert lines[0] == (f"kv_cache_memory_bytes {2 << 30} is more than cpu has in all ({1 << 30} bytes: its memory, "
                        "or its container's limit where lower)"), out.stderr
    default, quarter = lines[1].split()
    assert default == quarter


def test_a_cpu_quota_bounds_the_default_thread_count(valid_dir):
    """Under a quota of one CPU (docker --cpus 1) the pool has no thread beside the caller's,
    whatever CPUs the affinity allows (one a host CPU had each been throttled)."""
    group = _cgroup_v1("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"})
    if group is None:
        pytest.skip("cannot make a cgroup-v1 cpu group here")
    code = ("import os, sys, diffuserve as ds\nbefore = len(os.listdir('/proc/self/task'))\n"
            "model = ds.Model.load(sys.argv[1])\nmodel.sequence().prefill([2, 3, 4])\n"
            "print(len(os.listdir('/proc/self/task')) - before)")
    out = _run_in(group, code, valid_dir)
    assert out.stdout == "0\n", out.stdout + out.stderr


def test_weights_too_large_for_the_machine(ckpt):
    """Random weights (load_format "dummy") of sizes no memory holds: a ValueError saying so (it
    had been C++'s bare std::bad_alloc)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"].update(vocab_size=2**31 - 1, hidden_size=2**24)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="load_format 'dummy': the config's random weights take at least "
                                         r"\d+ bytes, more than the \d+ bytes of memory free for them"):
        ds.Model.load(ckpt, load_format="dummy")


def test_random_weights_each_within_memory_but_not_all_together_are_refused(ckpt):
    """Random weights that each fit in memory, but not all together (a config of 4096 wide
    layers, each an MLP of 0.8 GB: over 3 TB in all): refused before any is made, the bytes
    named. They had been made one by one until the kernel killed the process for want of
    memory."""
    config = json.loads((ckpt / "config.json").read_text())
    text = config["text_config"]
    text.update(num_hidden_layers=4096, hidden_size=8192, intermediate_size=16384,
                layer_types=["sliding_attention"] * 4095 + ["full_attention"],
                per_layer_config={"4095": text["per_layer_config"]["1"]})  # the full layer's shape, now last
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"load_format 'dummy': the config's random weights take at least (\d+) bytes, "
                                         r"more than the \d+ bytes of memory free for them") as refused:
        ds.Model.load(ckpt, load_format="dummy")
    assert int(re.search(r"at least (\d+)", str(refused.value)).group(1)) > 3 * 10**12
    assert time.perf_counter() - start < 30  # (nothing made: the walk counts)


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop(ROUTER))
    load_fails(ckpt, f"missing tensor '{ROUTER}'", "expected shape [4, 32]", str(ckpt))


def test_unexpected_tensor(ckpt):
    name = "model.decoder.layers.0.mystery.weight"
    rewrite(ckpt, lambda t: t.update({name: np.zeros(4, np.float32)}))
    load_fails(ckpt, f"unexpected tensor '{name}'", str(ckpt / "model.safetensors"))


def test_a_tensor_name_holding_nul_is_named_whole(ckpt):
    """A NUL in a name read from the file is written \\0: the message had ended at it."""
    rewrite(ckpt, lambda t: t.update({"x\0y": np.zeros(4, np.float32)}))
    load_fails(ckpt, "unexpected tensor 'x\\0y' (not part of a DiffusionGemma text model)")


def test_misshaped_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({ROUTER: np.zeros((5, 32), np.float32)}))
    load_fails(ckpt, f"tensor '{ROUTER}' has shape [5, 32], expected [4, 32]", str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("name", ["model.decoder.embed_tokens.weight", ROUTER, NORM])
def test_integer_dtype_tensor(ckpt, name):
    """An I32 tensor where a float weight belongs (the same bytes, reinterpreted) is refused."""
    rewrite(ckpt, lambda t: t.update({name: ("I32", t[name].view(np.int32))}))
    load_fails(ckpt, f"tensor '{name}' has dtype I32", "expected F32, BF16 or F16", str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("with_scale", [True, False], ids=["with its scale", "alone"])
def test_quantized_weight_without_quantization_config(ckpt, with_scale):
    """An E4M3 weight in a checkpoint whose config.json has no quantization_config contradicts
    itself (transformers would read its values unscaled): refused, named (with its scale it had
    loaded, dequantized; alone it was asked for a scale)."""
    name = "model.decoder.layers.0.self_attn.o_proj.weight"

    def quantize(t):
        t[name] = ("F8_E4M3", np.full(t[name].shape, 0x38, np.uint8))
        if with_scale:
            t[name + "_scale"] = np.full((t[name][1].shape[0], 1), 0.5, np.float32)
    rewrite(ckpt, quantize)
    load_fails(ckpt, f"'{name}' is stored quantized", "config.json has no quantization_config")


def test_vision_tower_tensors_ignored(ckpt, model):
    """Vision-tower tensors are accepted and change nothing."""
    rewrite(ckpt, lambda t: t.update({
        "model.encoder.vision_tower.encoder.layers.0.mlp.fc1.weight": np.ones((16, 16), np.float32),
        "model.encoder.vision_tower.patch_embedder.weight": ("I32", np.arange(6, dtype=np.int32)),
        "model.encoder.embed_vision.embedding_projection.weight": np.ones((32, 16), np.float32),
    }))
    np.testing.assert_array_equal(logits_of(ds.Model.load(ckpt)), logits_of(model))


# --- Model.load arguments ---------------------------------------------------------------------

def test_load_nonexistent_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ds.CheckpointError, match=re.escape(str(missing))):
        ds.Model.load(missing)


def test_load_bad_dtype(valid_dir):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        ds.Model.load(valid_dir, dtype="int8")


@pytest.mark.parametrize("device", ["tpu", "cuda", "cuda:99"])
def test_load_unavailable_device(valid_dir, device):
    """The message names the device as given (cuda:99 had been called 'cuda')."""
    if device == "cuda":
        try:
            ds.Model.load(valid_dir, device="cuda")
            pytest.skip("this build has a CUDA backend")
        except ValueError:
            pass
    with pytest.raises(ValueError, match=f"device '{device}' is not available"):
        ds.Model.load(valid_dir, device=device)


@pytest.mark.parametrize("threads", [1000, 100_000], ids=["more than the OS starts", "over the cap"])
def test_load_more_threads_than_the_system_allows(valid_dir, tmp_path, threads):
    """num_threads beyond what the process can start must raise ValueError (or load), never hang or abort."""
    script = (
        "import os, resource, diffuserve as ds\n"
        "# 1 GiB past what the process has mapped (a CUDA build maps more at import): ~100 thread\n"
        "# stacks, then EAGAIN.\n"
        "mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))\n"
        "try:\n"
        f"    ds.Model.load({str(valid_dir)!r}, num_threads={threads})\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
        "else:\n"
        "    print('loaded')\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=3)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Model.load(num_threads={threads}) hung")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"loaded\n|ValueError: .*num_threads.*\n", proc.stdout), proc.stdout


# --- Sequence arguments -----------------------------------------------------------------------

@pytest.mark.parametrize("op", ["prefill", "denoise", "commit"])
@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_token_id_out_of_range(seq, op, bad):
    """The message names the offending id and its index; nothing changes."""
    before = state_of(seq)
    ids = np.arange(CANVAS)
    ids[2] = bad
    with pytest.raises(ValueError, match=rf"{op}: token id {bad} at index 2 is out of range \[0, {VOCAB}\)"):
        getattr(seq, op)(ids)
    assert_intact(seq, before)


@pytest.mark.parametrize("op", ["prefill", "denoise", "commit"])
@pytest.mark.parametrize("ids, message", [
    (np.arange(CANVAS, dtype=np.float64), "token ids must be integers"),
    ([1.0] * CANVAS, "token ids must be integers"),
    ([True] * CANVAS, "token ids must be integers"),
    (np.arange(CANVAS).reshape(2, 4), r"token ids must be a 1-D sequence, got shape \(2, 4\)"),
    (np.int64(3), "token ids must be a 1-D sequence, got one int64, 3"),
    ([5, "6"] * (CANVAS // 2), "token ids must be integers, got dtype <U21"),
    ([5, [6]] * (CANVAS // 2), "token ids must be a 1-D sequence of integers, got list at index 1"),
    ([5, None] * (CANVAS // 2), "token ids must be integers, got NoneType at index 1"),
    (iter(range(CANVAS)), r"token ids must be a sequence \(a list or an array\), got an iterator"),
    # (numpy files timedelta64 under integer; its copy of a masked array drops the mask.)
    (np.arange(CANVAS).astype("timedelta64[s]"), "token ids must be integers, got dtype timedelta64"),
    (np.ma.masked_array(np.arange(CANVAS), mask=[0, 1] * (CANVAS // 2)), "token ids must not hold masked values"),
], ids=["float array", "float list", "bool", "2-D", "one id", "text", "nested", "None", "iterator", "timedelta",
        "masked"])
def test_token_ids_wrong_type_or_rank(seq, op, ids, message):
    before = state_of(seq)
    with pytest.raises(ValueError, match=f"{op}: {message}"):
        getattr(seq, op)(ids)
    assert_intact(seq, before)


@pytest.mark.parametrize("op", ["prefill", "commit"])
def test_empty_ids(seq, op):
    before = state_of(seq)
    with pytest.raises(ValueError, match=f"{op}: no tokens given"):
        getattr(seq, op)([])
    assert_intact(seq, before)


@pytest.mark.parametrize("op", ["denoise", "commit"])
def test_before_prefill(model, op):
    """denoise and commit need a prefilled cache."""
    s = model.sequence()
    before = state_of(s)
    with pytest.raises(ValueError, match=f"{op}: call prefill"):
        getattr(s, op)(np.arange(CANVAS))
    if op == "denoise":  # (logits of the wrong shape had been named instead)
        with pytest.raises(ValueError, match="denoise: call prefill"):
            s.denoise(np.arange(CANVAS), np.zeros((CANVAS - 1, VOCAB), np.float32))
    assert_intact(s, before)


@pytest.mark.parametrize("logits_rows", [None, CANVAS, "n"], ids=["", "with right logits", "with the canvas's logits"])
@pytest.mark.parametrize("n", [CANVAS - 1, CANVAS + 1])
def test_denoise_wrong_canvas_length(seq, n, logits_rows):
    """The canvas is named, also beside self-conditioning logits of the right shape (the
    native binding had checked them against the canvas given, and blamed them), or of the
    wrong canvas's (which had been named instead of the canvas)."""
    before = state_of(seq)
    sc = None if logits_rows is None else np.zeros((n if logits_rows == "n" else CANVAS, VOCAB), np.float32)
    for denoise in (seq.denoise, seq._native.denoise):
        with pytest.raises(ValueError, match=f"denoise: canvas has {n} tokens, expected canvas_length {CANVAS}"):
            denoise(np.arange(n, dtype=np.int32), sc)
    assert_intact(seq, before)


def test_sequence_canvas_past_the_models(model):
    """The message names the model's canvas and does not offer 0, which Python spells None."""
    with pytest.raises(ValueError, match=rf"^canvas_length must be at most the model's canvas_length \({CANVAS}\), "
                                         rf"got {CANVAS + 1}$"):
        model.sequence(canvas_length=CANVAS + 1)


def test_commit_longer_than_canvas(seq):
    before = state_of(seq)
    with pytest.raises(ValueError, match=f"commit: block of {CANVAS + 1} tokens is longer than canvas_length {CANVAS}"):
        seq.commit(np.arange(CANVAS + 1))
    assert_intact(seq, before)


def test_a_sequence_says_what_it_holds(model):
    s = model.sequence(canvas_length=CANVAS - 2)
    s.prefill(PROMPT)
    assert repr(s) == f"Sequence(tokens={len(PROMPT)}, canvas_length={CANVAS - 2}, model={model!r})"


def test_a_sequence_is_not_copied(seq):
    """A copy would share the sequence's KV cache (a commit to one had shown in the other)."""
    import copy
    import pickle
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="a Sequence cannot be copied or pickled"):
            duplicate(seq)
    with pytest.raises(ValueError, match="model must be a diffuserve Model, got object"):
        ds.Sequence(object())


def test_masked_self_conditioning_logits_are_refused(seq):
    before = state_of(seq)
    sc = np.ma.masked_array(np.zeros((CANVAS, VOCAB), np.float32), mask=False)
    sc[0, 3] = np.ma.masked
    with pytest.raises(ValueError, match="self_conditioning_logits must not hold masked values"):
        seq.denoise(np.arange(CANVAS), sc)
    assert_intact(seq, before)


@pytest.mark.parametrize("shape", [(CANVAS, VOCAB - 1), (CANVAS - 1, VOCAB), (CANVAS * VOCAB,), (2, CANVAS, VOCAB)])
def test_self_conditioning_wrong_shape(seq, shape):
    before = state_of(seq)
    with pytest.raises(ValueError, match="self_conditioning_logits must have shape"):
        seq.denoise(np.arange(CANVAS), np.zeros(shape, np.float32))
    assert_intact(seq, before)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_self_conditioning_non_finite(seq, value):
    """NaN or +inf is refused, naming the row and column."""
    before = state_of(seq)
    sc = np.zeros((CANVAS, VOCAB), np.float32)
    sc[3, 5] = value
    with pytest.raises(ValueError, match=r"self_conditioning_logits holds NaN or \+inf at row 3, column 5"):
        seq.denoise(np.arange(CANVAS), sc)
    assert_intact(seq, before)


@pytest.mark.parametrize("make, message", [
    (lambda sc: sc.astype(np.float64) * 1e300, r"holds np.float64\(1e\+300\) at \(0, 0\), past float32's range"),
    (lambda sc: sc.astype(np.complex64), "must be real numbers, got dtype complex64"),
    (lambda sc: np.full(sc.shape, None), "must be real numbers, got dtype object"),
    (lambda sc: "logits", "must be real numbers, got dtype <U6"),
])
def test_self_conditioning_that_is_not_float32_numbers_is_named(seq, make, message):
    """A value float32 cannot hold, complex numbers (whose imaginary part had been dropped with
    numpy's warning alone) and non-numbers are ValueErrors naming the argument and the cause."""
    before = state_of(seq)
    with pytest.raises(ValueError, match="denoise: self_conditioning_logits " + message):
        seq.denoise(np.arange(CANVAS), make(np.ones((CANVAS, VOCAB), np.float32)))
    assert_intact(seq, before)


def test_self_conditioning_as_a_torch_bf16_tensor(seq):
    """A torch tensor of any float dtype is taken (bf16, which numpy lacks, had been a TypeError)."""
    torch = pytest.importorskip("torch")
    sc = np.random.default_rng(0).standard_normal((CANVAS, VOCAB)).astype(np.float32)
    rounded = torch.from_numpy(sc).to(torch.bfloat16)
    np.testing.assert_array_equal(seq.denoise(np.arange(CANVAS), rounded),
                                  seq.denoise(np.arange(CANVAS), rounded.float().numpy()))


def test_self_conditioning_neg_inf_entries_accepted(seq):
    """-inf marks a token the sampler ruled out: it is valid input and the logits stay finite."""
    sc = np.zeros((CANVAS, VOCAB), np.float32)
    sc[:, ::2] = -np.inf
    assert np.isfinite(seq.denoise(np.arange(CANVAS), sc)).all()


def test_self_conditioning_row_all_neg_inf(seq):
    """A row with no finite logit (its softmax is 0/0) is refused, naming the row."""
    before = state_of(seq)
    sc = np.zeros((CANVAS, VOCAB), np.float32)
    sc[3] = -np.inf
    with pytest.raises(ValueError, match="self_conditioning_logits row 3 is all -inf"):
        seq.denoise(np.arange(CANVAS), sc)
    assert_intact(seq, before)


@pytest.mark.parametrize("args, message", [
    (["serve", "--port", "70000"], "--port: 70000 is outside [0, 65535]"),
    (["serve", "--kv-cache-gib", "nan"], "--kv-cache-gib: nan is outside"),
    (["serve", "--shutdown-timeout", "-5"], "--shutdown-timeout: -5 is outside"),
    (["generate", "hi", "--max-tokens", "2147483648"], "--max-tokens: 2147483648 is outside [1, 2147483647]"),
    (["bench", "--concurrency", "1,0"], "--concurrency: 0 is outside"),
    (["bench", "--concurrency", "a"], "--concurrency: 'a' is not an integer"),
    # (A row's prompts are drawn at once: two billion of them had run out of memory.)
    (["bench", "--concurrency", "1,2147483647"], "--concurrency: 2147483647 is outside [1, 65536]"),
    (["bench", "--steps", "0"], "--steps: 0 is outside"),
    # Sudoku options that the way of solving chosen would leave unused (they had been ignored).
    (["sudoku", "--output", "out.txt"], "--output needs --eval"),
    (["sudoku", "0" * 81, "--eval", "in.txt"], "give PUZZLE or --eval FILE, not both"),
    (["sudoku", "0" * 81, "--givens", "30"], "--givens is for a generated puzzle, not for PUZZLE or --eval FILE"),
    (["sudoku", "--eval", "in.txt", "--output", "./in.txt"], "--output is the --eval file itself"),
    (["sudoku", "--eval", "in.txt", "--output", "/nonexistent/out.txt"], "not a file in an existing folder"),
])
def test_cli_bad_values_are_usage_errors(args, message):
    """A bad option value is argparse's usage error naming the option (exit 2), before any
    model loads, not a traceback from deeper down."""
    result = subprocess.run([sys.executable, "-m", "diffuserve", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cli_version():
    result = subprocess.run([sys.executable, "-m", "diffuserve", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == f"diffuserve {ds.__version__}\n", result


@pytest.mark.parametrize("raw", [[], ["--raw"]], ids=["chat template", "raw"])
def test_cli_prompt_not_unicode(raw):
    """A prompt from bytes that are not UTF-8 (argv keeps them as lone surrogates) is an
    error naming the character in the prompt itself, not in the chat-templated text."""
    prompt = os.fsdecode(b"a\xffb")
    result = subprocess.run([sys.executable, "-m", "diffuserve", "generate", prompt, *raw], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: the prompt is not valid UTF-8: byte 0xff at character 1" in result.stderr


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, for the CLI's text output."""
    from chat_checkpoint import write_chat_checkpoint
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"))


def test_cli_output_that_cannot_be_written(chat_dir):
    """A reader that leaves (`| head -c 1`) ends generate quietly with the shell's code for
    SIGPIPE, and a full disk is an error line: both had been tracebacks."""
    # Text still coming after the reader has left: an EOS drawn early had ended the output
    # before the reader closed the pipe (an unseeded run, now and then).
    command = [sys.executable, "-m", "diffuserve", "generate", "Hello", "-m", str(chat_dir), "--raw",
               "--ignore-eos", "--max-tokens", "20000"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.communicate(timeout=300)[1].decode()
    assert proc.returncode == 141 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    with open("/dev/full", "w") as full:
        result = subprocess.run(command[:-1] + ["64"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: [Errno 28] No space left on device" in result.stderr


def test_cli_generate_without_max_tokens_takes_the_context(chat_dir, tmp_path):
    """Without --max-tokens and a length in generation_config.json, generate runs to the whole
    blocks the context has room for, as the server without max_tokens does (it had stopped at
    the runtime's default 256)."""
    ckpt = shutil.copytree(chat_dir, tmp_path / "ck")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 400
    (ckpt / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "diffuserve", "generate", "Hi", "-m", str(ckpt), "--raw",
                             "--ignore-eos", "--seed", "1", "--max-denoising-steps", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "[384 tokens in 24 blocks" in result.stderr, result.stderr


@pytest.mark.parametrize("stderr", ["closed", "/dev/full"])
def test_cli_with_stderr_unwritable(chat_dir, stderr):
    """A command whose standard error is closed, or cannot be written, still runs: its status
    lines are dropped (it had exited 1 at the loading line, saying nothing)."""
    if stderr == "/dev/full" and not os.path.exists(stderr):
        pytest.skip("no /dev/full here")
    # (unseeded, an EOS drawn first had left stdout empty now and then)
    command = [sys.executable, "-m", "diffuserve", "generate", "Hello", "-m", str(chat_dir), "--raw",
               "--max-tokens", "16", "--seed", "1", "--ignore-eos"]
    if stderr == "closed":
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=300,
                                preexec_fn=lambda: os.close(2))
    else:
        with open(stderr, "w") as full:
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=full, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip(), result


def test_cli_text_the_terminal_cannot_encode(chat_dir):
    """Generated text on a terminal whose encoding lacks its characters comes out replaced
    (it had been a UnicodeEncodeError traceback)."""
    result = subprocess.run([sys.executable, "-m", "diffuserve", "generate", "Hello", "-m", str(chat_dir), "--raw",
                             "--max-tokens", "512", "--seed", "1"], capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr.decode()


def test_cli_loads_past_a_link_to_nothing(chat_dir, tmp_path):
    """A .safetensors link to nothing (a half-cleaned Hugging Face cache) that the checkpoint
    does not need leaves the load alone (the loading line's size had raised FileNotFoundError);
    where model.safetensors itself is one, the error says so."""
    ckpt = shutil.copytree(chat_dir, tmp_path / "ck")
    (ckpt / "extra.safetensors").symlink_to(tmp_path / "gone")
    result = subprocess.run([sys.executable, "-m", "diffuserve", "generate", "Hi", "-m", str(ckpt), "--raw",
                             "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(ds.CheckpointError, match=r"model.safetensors: a symbolic link to .*blob, which does not exist"):
        ds.Model.load(ckpt)


def test_path_that_is_not_utf8(valid_dir, tmp_path):
    """A checkpoint folder named by bytes that are not UTF-8 is a ValueError naming it (the
    native module had raised a TypeError about its arguments)."""
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff")
    shutil.copytree(valid_dir, path)
    for load in (ds.Model.load, ds.LLM):
        with pytest.raises(ValueError, match="is not valid UTF-8"):
            load(path)


def test_cli_refuses_an_address_it_cannot_listen_on():
    """A port in use is an error line before the model loads (uvicorn's had come among its log
    lines, after "serving ... at")."""
    pytest.importorskip("fastapi")  # (the server's: a GPU machine's Python may lack it)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "diffuserve", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}" in result.stderr and "serving" not in result.stderr


def test_cli_refuses_an_empty_host():
    """An empty --host (a setting left empty) had bound every interface, and printed the URL
    http://:PORT/v1."""
    pytest.importorskip("fastapi")  # (the server's: a GPU machine's Python may lack it)
    result = subprocess.run([sys.executable, "-m", "diffuserve", "serve", "--host", "", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "error: --host is empty" in result.stderr, result.stderr


def test_cli_eval_file_that_is_not_utf8(tmp_path):
    puzzles = tmp_path / "puzzles.txt"
    puzzles.write_bytes(b"\xff\xfe\n")
    result = subprocess.run([sys.executable, "-m", "diffuserve", "sudoku", "--eval", str(puzzles)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and f"error: {puzzles} is not UTF-8 text" in result.stderr, result.stderr


def test_cli_names_the_device_as_given():
    """An unavailable device is an error line naming it as given ('cuda:99' had read 'cuda')."""
    result = subprocess.run([sys.executable, "-m", "diffuserve", "generate", "hi", "--device", "cuda:99"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: device 'cuda:99' is not available" in result.stderr


def test_cli_ctrl_c_is_a_line_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT) while a command runs ends it with a line and the shell's code 130,
    not a KeyboardInterrupt traceback."""
    import random
    import signal
    from diffuserve import sudoku as sd

    rng = random.Random(0)
    puzzles = tmp_path / "puzzles.txt"  # enough to take minutes
    puzzles.write_text("".join(sd.generate(30, rng, unique=False)[0] + "\n" for _ in range(200)))
    # SIGINT handled as in a terminal's foreground job, even where this process was started
    # with it ignored (a shell's background job, which its children inherit).
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from diffuserve.cli import main; main(sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", main, "sudoku", "--eval", str(puzzles)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr = b""
    while b"loading" not in stderr:  # the command has begun (its model loads, then it solves)
        chunk = proc.stderr.read1(4096)
        assert chunk, stderr.decode()
        stderr += chunk
    proc.send_signal(signal.SIGINT)
    stderr += proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and b"Traceback" not in stderr, stderr.decode()
    assert stderr.endswith(b"interrupted\n")


# --- weights that are not finite ----------------------------------------------------------------

@pytest.fixture(scope="module", params=[np.nan, np.inf], ids=["nan", "inf"])
def nan_dir(request, tmp_path_factory, valid_dir):
    """The valid checkpoint with a NaN, or an infinity, in its final norm's weight: every logit
    is NaN (an infinite one becomes NaN at the softcap, where tanh had made the cap of it, and
    such a checkpoint's requests had finished with tokens drawn from logits all at +-30)."""
    path = shutil.copytree(valid_dir, tmp_path_factory.mktemp("nan") / "m")
    rewrite(path, lambda t: t[NORM].__setitem__(3, request.param))
    return path


@pytest.mark.parametrize("name, index", [
    ("model.decoder.embed_tokens.weight", (3, 5)),               # a plain weight, uploaded as stored
    ("model.decoder.layers.0.mlp.up_proj.weight", (7, 1)),       # stacked with gate_proj on the host
    ("model.decoder.layers.1.experts.down_proj", (2, 30, 15)),   # an expert stack
    (NORM, (4,)),                                                # a norm's weight, read into fp32
])
@pytest.mark.parametrize("dtype, value", [("float16", 65520.0), ("float16", -1e30), ("bfloat16", 3.4e38)])
def test_a_weight_past_the_weight_dtypes_range_is_named_at_load(ckpt, name, index, dtype, value):
    """A finite weight the load's dtype cannot hold (float16's largest finite value is 65504:
    65520 rounds past it) would load as infinity, and the logits it reaches would be refused
    with nothing naming it: the load names the tensor, the value and its place."""
    def edit(tensors):
        tensors[name][index] = value
    rewrite(ckpt, edit)
    flat = int(np.ravel_multi_index(index, load_file(ckpt / "model.safetensors")[name].shape))
    with pytest.raises(ds.CheckpointError, match=re.escape(f"tensor '{name}' holds ")) as info:
        ds.Model.load(ckpt, dtype=dtype)
    assert f"(flat index {flat}), past the largest finite {dtype} value" in str(info.value)
    assert str(ckpt / "model.safetensors") in str(info.value)
    ds.Model.load(ckpt, dtype="float32")  # where it fits, it loads


def test_values_at_the_edge_of_float16_and_stored_infinities_load_in_float16(ckpt):
    """65504 and -65519 round to float16's largest finite values; an infinity stored in the
    checkpoint is its own, passed on as the reference passes it (its logits are refused later)."""
    def edit(tensors):
        tensors[NORM][:3] = [65504.0, -65519.0, np.inf]
    rewrite(ckpt, edit)
    ds.Model.load(ckpt, dtype="float16")


def test_non_finite_logits_are_refused_by_denoise(nan_dir):
    s = ds.Model.load(nan_dir).sequence()
    s.prefill(PROMPT)
    with pytest.raises(ds.CheckpointError,  # (as generate's: the weights' fault, not the caller's)
                       match=r"denoise: the model's logits hold NaN at row 0, column 0: .* not finite"):
        s.denoise(np.arange(CANVAS) + 2)


def test_nan_query_weight_fails_the_request(ckpt):
    """One NaN in a query projection makes every score of its heads NaN: the attention's output
    there is NaN, as the reference's softmax makes it, so the logits are refused (it had
    written zeros for rows whose scores were all NaN, and the logits came out finite)."""
    rewrite(ckpt, lambda t: t["model.decoder.layers.0.self_attn.q_proj.weight"].__setitem__((5, 7), np.nan))
    llm = ds.LLM(ckpt, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ds.CheckpointError, match=r"prompt 0: the model's logits held NaN or infinity"):
        llm.generate([[2, 3, 4]], ds.SamplingParams(max_new_tokens=16, seed=0))


NAN_EXPERT = "model.decoder.layers.1.experts.down_proj"  # the last layer's: only rows routed to it go NaN


def canvas_with_some_nan_rows(path, prompt, seed=0):
    """A canvas of which some rows, but not all, reach the checkpoint's NaN expert (NAN_EXPERT)
    in transformers' reference, and those rows."""
    from hf_reference import ReferenceSequence, load
    reference, rng = load(path), np.random.default_rng(seed)
    for _ in range(500):
        canvas = rng.integers(3, VOCAB, CANVAS).tolist()
        sequence = ReferenceSequence(reference)
        sequence.prefill(prompt)
        nan_rows = [i for i, row in enumerate(sequence.denoise(canvas)) if not np.isfinite(row).all()]
        if 0 < len(nan_rows) < CANVAS:
            return canvas, nan_rows
    raise AssertionError("no canvas of 500 has some rows, not all, routed to the NaN expert")


def test_nan_logits_at_pinned_positions_fail_the_request(ckpt):
    """Logits that are NaN only at pinned positions (an infilling canvas whose given tokens
    route to a broken expert) fail the request, as Sequence.denoise refuses them: the canvas
    update had checked the free positions alone, and such a request finished with tokens."""
    rewrite(ckpt, lambda t: t[NAN_EXPERT].__setitem__(2, np.nan))
    canvas, nan_rows = canvas_with_some_nan_rows(ckpt, PROMPT)
    llm = ds.LLM(ckpt, kv_cache_memory_bytes=8 << 20)
    for self_conditioning in (False, True):
        params = ds.SamplingParams(max_new_tokens=CANVAS, seed=0, seed_canvas=canvas, pinned_positions=nan_rows,
                                   max_denoising_steps=1, self_conditioning=self_conditioning)
        with pytest.raises(ds.CheckpointError, match=r"prompt 0: the model's logits held NaN or infinity at denoise "
                                                     r"step 1 of block 0"):
            llm.generate([PROMPT], params)
        assert not llm.has_unfinished()


def test_non_finite_logits_give_no_draft(nan_dir):
    """A step cut short (interrupt, as AsyncLLM's when a client leaves) returns before the
    failure is posted: the request's draft is then none, not the argmax of NaN rows (ids 0,
    which a stream of drafts had sent before the error)."""
    llm = ds.LLM(nan_dir, kv_cache_memory_bytes=8 << 20)
    rid = llm.add_request([2, 3, 4], ds.SamplingParams(max_new_tokens=16, seed=0))
    llm.interrupt()
    assert llm.step() == [] and llm.draft(rid) == []
    [output] = llm.step()
    assert output.finish_reason == "error" and "NaN or infinity" in output.error


@pytest.mark.parametrize("fuse_commit", [True, False])
def test_non_finite_logits_fail_the_request(nan_dir, fuse_commit):
    """generate raises naming the prompt and the step that failed, the first (where it had
    returned pad tokens, and later named the second: the host reads a block's stop flag only
    once its stop rule could fire); the LLM goes on."""
    llm = ds.LLM(nan_dir, kv_cache_memory_bytes=8 << 20, fuse_commit=fuse_commit)
    for _ in range(2):
        with pytest.raises(ds.CheckpointError, match=r"prompt 0: the model's logits held NaN or infinity at denoise "
                                                     r"step 1 of block 0"):
            llm.generate([[2, 3, 4], [5, 6]], ds.SamplingParams(max_new_tokens=16, seed=0, max_denoising_steps=5))
        assert not llm.has_unfinished()
    # Found at once however late the stop rule could fire (a threshold of 200 had run 200
    # more passes first), whether a step runs several passes or one.
    for stepper in (llm, ds.LLM(nan_dir, kv_cache_memory_bytes=8 << 20, fuse_commit=fuse_commit, slice_steps=1)):
        passes = stepper.stats()["forward_passes"]
        with pytest.raises(ds.CheckpointError, match=r"at denoise step 1 of block 0"):
            stepper.generate([[2, 3, 4]], ds.SamplingParams(max_new_tokens=16, seed=0, max_denoising_steps=400,
                                                            stability_threshold=200))
        assert stepper.stats()["forward_passes"] - passes <= 3


def test_cli_bench_fails_on_failed_requests(nan_dir):
    """No throughput table for requests that failed (it had printed ~16,000 tok/s and exit 0)."""
    result = subprocess.run([sys.executable, "-m", "diffuserve", "bench", str(nan_dir), "--concurrency", "1",
                             "--prompt-tokens", "4", "--max-tokens", "8", "--steps", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "error: a request failed: the model's logits held NaN" in result.stderr
    assert "tok/s |" not in result.stdout, result.stdout


def test_non_finite_logits_fail_the_server_request(nan_dir):
    import asyncio
    from diffuserve.async_llm import AsyncLLM, RequestFailed

    engine = AsyncLLM(ds.LLM(nan_dir, kv_cache_memory_bytes=8 << 20))

    async def run():
        async for _ in engine.generate([2, 3, 4], ds.SamplingParams(max_new_tokens=8, seed=0)):
            pass

    try:
        for _ in range(2):  # the engine thread goes on after the first
            with pytest.raises(RequestFailed, match="NaN or infinity"):
                asyncio.run(run())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("ids", [[2**63, 1], [2, 2**70]], ids=["past int64 beside a small id", "past int64"])
def test_token_ids_past_int64_are_out_of_range(seq, ids):
    with pytest.raises(ValueError, match=r"prefill: token id \d+ at index \d is out of range \[0, 64\)"):
        seq.prefill(ids)


def test_token_ids_that_numpy_makes_floats_are_taken_as_ints(model):
    """A np.uint64 beside Python ints makes numpy's array float64: the ids, each an integer in
    range, are taken (they had been refused as "got dtype float64")."""
    given, plain = model.sequence(), model.sequence()
    given.prefill([np.uint64(2), 3, 4])
    plain.prefill([2, 3, 4])
    np.testing.assert_array_equal(given.denoise(np.arange(CANVAS)), plain.denoise(np.arange(CANVAS)))


@pytest.mark.parametrize("make, message", [
    (lambda torch, sc: torch.from_numpy(sc).to(torch.complex64), "must be real numbers, got dtype torch.complex64"),
    (lambda torch, sc: torch.from_numpy(sc) > 0, "must be real numbers, got dtype torch.bool"),
    (lambda torch, sc: torch.empty(sc.shape, device="meta"), "cannot be read as numbers"),
])
def test_self_conditioning_torch_tensors_that_are_not_real_numbers(seq, make, message):
    """torch's complex and bool tensors are refused as numpy's are (.float() had dropped the
    imaginary part, or made 0/1 logits), and a meta tensor, which holds no values, by name (a
    NotImplementedError)."""
    torch = pytest.importorskip("torch")
    before = state_of(seq)
    with pytest.raises(ValueError, match="denoise: self_conditioning_logits " + message):
        seq.denoise(np.arange(CANVAS), make(torch, np.ones((CANVAS, VOCAB), np.float32)))
    assert_intact(seq, before)


@pytest.mark.parametrize("dtype", ["bfloat16", "meta"])
def test_token_ids_as_a_torch_tensor_numpy_cannot_read(seq, dtype):
    """A bf16 or meta tensor as token ids is a ValueError naming them (a TypeError from numpy)."""
    torch = pytest.importorskip("torch")
    ids = torch.tensor([2, 3], dtype=torch.bfloat16) if dtype == "bfloat16" else torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="prefill: token ids must be integers, got torch.(bfloat16|float32)"):
        seq.prefill(ids)


@pytest.fixture(scope="module")
def llm(valid_dir):
    return ds.LLM(valid_dir, kv_cache_memory_bytes=8 << 20)


NOT_A_PATH = r"path \(a checkpoint directory\) must be a str or os.PathLike without NUL characters, got 5"
BAD_LLM_CALLS = {
    # (had been the TypeError "len() of unsized object")
    "0-d array as prompts": (lambda llm: llm.generate(np.array(5)),
                             r"prompts must be a list of prompts \(token ids or text\), got a 0-d array, array\(5\)"),
    "token id past uint64": (lambda llm: llm.generate([[2, 2**64]]),
                             r"prompt 0: prompt: token id 18446744073709551616 at index 1 is out of range \[0, 64\)"),
    # (had been numpy's "setting an array element with a sequence ... inhomogeneous shape")
    "a list among the ids": (lambda llm: llm.generate([[2, [3]]]),
                             r"prompt 0: prompt: token ids must be a 1-D sequence of integers, got list at index 1"),
    # (these had been nanobind's TypeError "incompatible function arguments")
    "request id past uint64": (lambda llm: llm.generated(2**64),
                               r"request_id must be an integer in \[0, 2\*\*63 - 1\], got 18446744073709551616"),
    "negative request id": (lambda llm: llm.draft(-1), r"request_id must be an integer in \[0, 2\*\*63 - 1\], got -1"),
    "request id a string": (lambda llm: llm.denoise_steps("0"), r"request_id must be an integer .*, got '0'"),
    # (these had been os.fspath's TypeError "expected str, bytes or os.PathLike object, not int")
    "LLM path an int": (lambda llm: ds.LLM(5), NOT_A_PATH),
    "Model path an int": (lambda llm: ds.Model.load(5), NOT_A_PATH),
    "Tokenizer path an int": (lambda llm: ds.Tokenizer(5), NOT_A_PATH),
    "tokenizer lookup path an int": (lambda llm: ds.Tokenizer.from_checkpoint(5), NOT_A_PATH),
}


@pytest.mark.parametrize("case", BAD_LLM_CALLS)
def test_llm_bad_arguments(llm, case):
    """A ValueError naming the argument and what it may be; nothing stays queued."""
    call, message = BAD_LLM_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.has_unfinished()


def test_path_with_nul(valid_dir):
    with pytest.raises(ValueError, match="NUL"):
        ds.Model.load(str(valid_dir) + "\0x")


@pytest.mark.parametrize("kwargs, name", [(dict(load_format=None), "load_format"),
                                          (dict(quantization=5), "quantization")])
def test_load_option_types(valid_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ds.Model.load(valid_dir, **kwargs)


def test_cli_bench_request_too_long_is_an_error_line(valid_dir):
    result = subprocess.run([sys.executable, "-m", "diffuserve", "bench", str(valid_dir), "--prompt-tokens", "10000000",
                             "--concurrency", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "error: " in result.stderr and "Traceback" not in result.stderr, result.stderr


FORKED_CHILD = """
import os, sys
import numpy as np
import diffuserve as ds
model = ds.Model.load(sys.argv[1], num_threads=int(sys.argv[2]))
def logits():
    seq = model.sequence()
    seq.prefill([2, 5, 7, 11, 13])
    return seq.denoise(np.arange(8) + 2)
expected = logits()
pid = os.fork()
if pid == 0:  # the child computes alone (the parent's threads are not its own), then exits
    equal = np.array_equal(logits(), expected)
    del model
    os._exit(0 if equal else 3) if sys.argv[3] == "os_exit" else sys.exit(0 if equal else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("work", [
    "llm = ds.LLM(path)\nwhile True:\n    llm.generate([[2, 3, 4]] * 4, ds.SamplingParams(max_new_tokens=256, "
    "max_denoising_steps=48, eos_token_id=[]))",
    "sequence = ds.Model.load(path).sequence()\nsequence.prefill([2, 3, 4])\nwhile True:\n    "
    "sequence.denoise([5] * CANVAS)"], ids=["LLM.generate", "Sequence.denoise"])
def test_a_process_exits_while_a_daemon_thread_computes(valid_dir, work):
    """A user's daemon thread inside a native call as the interpreter exits: the process exits
    cleanly (the thread, taking the GIL back during finalization, had been ended by
    pthread_exit, whose unwinding through the bindings' C++ frames aborted the process)."""
    body = "".join("    " + line + "\n" for line in work.replace("CANVAS", str(CANVAS)).splitlines())
    code = (f"import sys, threading, time, diffuserve as ds\npath = sys.argv[1]\nstarted = threading.Event()\n"
            f"def run():\n    started.set()\n{body}"
            "threading.Thread(target=run, daemon=True).start()\nstarted.wait()\ntime.sleep(0.3)\nprint('exiting')\n")
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", code, str(valid_dir)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout == "exiting\n", proc.stderr[-2000:]
        assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_an_exit_hook_registered_before_the_import_may_wait_for_a_thread_that_computes(valid_dir):
    """An exit hook registered before diffuserve was imported runs after the package's own: one
    that stops a worker thread computing with diffuserve and joins it gets it back (the first
    form of the parking above had parked the worker as the package's hook ran: a hang)."""
    code = ("import atexit, sys, threading, time\nstop = threading.Event()\n"
            "def cleanup():\n    stop.set()\n    worker.join(10)\n"
            "    print('joined' if not worker.is_alive() else 'still running', flush=True)\n"
            "atexit.register(cleanup)\nimport diffuserve as ds\n"
            "sequence = ds.Model.load(sys.argv[1]).sequence()\nsequence.prefill([2, 3, 4])\n"
            "def work():\n    while not stop.is_set():\n"
            f"        sequence.denoise([5] * {CANVAS})\n"
            "worker = threading.Thread(target=work, daemon=True)\nworker.start()\ntime.sleep(0.3)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(valid_dir)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "joined\n", proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("exit_by", ["sys_exit", "os_exit"])
@pytest.mark.parametrize("num_threads", [4, 0])
def test_a_forked_child_computes_and_exits(valid_dir, num_threads, exit_by):
    """A process forked after a load computes the same logits and exits cleanly: its teardown
    had joined the parent's worker threads (a crash) or destroyed their condition variables
    (a hang)."""
    result = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(valid_dir), str(num_threads), exit_by],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "child 0", result.stdout + result.stderr


FORKED_IN_USE = """
import os, sys, threading, time
import diffuserve as ds
path = sys.argv[1]
llm = ds.LLM(path, slice_steps=100_000)  # one step runs the whole request, holding the model throughout
started = threading.Event()
def run():
    started.set()
    llm.generate([[2, 3, 4]], ds.SamplingParams(max_new_tokens=8192, max_denoising_steps=48, eos_token_id=[]))
threading.Thread(target=run, daemon=True).start()
started.wait()
time.sleep(0.3)
pid = os.fork()
if pid == 0:
    for name, call in [("LLM", lambda: llm.generate([[2, 3]])), ("Model", lambda: llm.model.sequence().prefill([2]))]:
        try:
            call()
            print(name, "ran", flush=True)
        except ValueError as e:
            print(name, "refused:", e, flush=True)
    fresh = ds.LLM(path).generate([[2, 3]], ds.SamplingParams(max_new_tokens=8, seed=0))[0]
    print("a new LLM generated", len(fresh.token_ids), flush=True)
    os._exit(0)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
os._exit(0)
"""


def test_a_child_forked_while_another_thread_uses_the_llm_refuses_it(valid_dir):
    """A fork while another thread's call holds the LLM and its model: in the child that thread
    does not exist, and the LLM and model, half-way through its call, refuse every call (the
    child had waited for them forever); a new LLM there works."""
    result = subprocess.run([sys.executable, "-c", FORKED_IN_USE, str(valid_dir)], capture_output=True, text=True,
                            timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 4, result.stdout + result.stderr
    assert lines[0] == ("LLM refused: this LLM was in use by another thread when the process forked: in this process "
                        "its state is that call's, half done, and that thread does not exist; create the LLM again "
                        "here (or fork while no thread uses it)")
    assert lines[1].startswith("Model refused: this model was in use by another thread when the process forked")
    assert lines[2:] == ["a new LLM generated 8", "child 0"]


ASYNC_LEFT_RUNNING = """
import asyncio, sys
import diffuserve as ds
from diffuserve.async_llm import AsyncLLM
engine = AsyncLLM(ds.LLM(sys.argv[1]))
async def start():
    stream = engine.generate([2, 5, 7], ds.SamplingParams(max_new_tokens=4096, eos_token_id=[], seed=0))
    await stream.__anext__()  # accepted: the engine thread now steps it
    return stream
stream = asyncio.run(start())
print("exiting", flush=True)
"""


def test_exiting_with_an_async_engine_mid_request_is_clean(valid_dir):
    """A program that exits while its AsyncLLM still runs a request (no shutdown()): the
    engine stops first (the process had aborted, SIGABRT, as the interpreter finalized
    under its thread's native step)."""
    result = subprocess.run([sys.executable, "-c", ASYNC_LEFT_RUNNING, str(valid_dir)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == "exiting\n", result.stdout + result.stderr


def test_dropping_a_sequence_does_not_wait_for_another_threads_pass(tmp_path):
    """A Sequence dropped while another thread's pass holds the model is gone at once, its KV
    blocks released by the model's next call: it had waited for that pass holding the GIL,
    which stalled every Python thread for as long. (A pass of about 2 s here; the drop must
    take less than half of it, which a drop that waits for the pass cannot.)"""
    path = write_random_checkpoint(tmp_path / "m", canvas_length=CANVAS, **dict(TINY, hidden_size=1024,
                                                                                  intermediate_size=1024))
    model = ds.Model.load(path, kv_cache_memory_bytes=64 << 20, num_threads=1)
    free = model.cache_stats()["kv_blocks_free"]
    dropped, busy = model.sequence(), model.sequence()
    dropped.prefill(np.arange(40) % VOCAB)
    started, pass_seconds = threading.Event(), []

    def run():
        started.set()
        begin = time.perf_counter()
        busy.prefill(np.arange(4000) % VOCAB)
        pass_seconds.append(time.perf_counter() - begin)

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    time.sleep(0.3)  # the pass under way
    begin = time.perf_counter()
    del dropped
    drop_seconds = time.perf_counter() - begin
    worker.join()
    assert drop_seconds < pass_seconds[0] / 2, (drop_seconds, pass_seconds)
    del busy
    assert model.cache_stats()["kv_blocks_free"] == free
