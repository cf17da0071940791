"""Quantized checkpoints as LLM Compressor writes them (compressed-tensors FP8 dynamic and
NVFP4, experts stored one linear per expert, encoder copies of the shared weights): the
CPU backend dequantizes them, and must match transformers running the same model with
weights dequantized independently here (torch, from the format's definition)."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

import diffuserve as ds
from hf_reference import ReferenceSequence

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "quantized")
SCHEMES = ["FP8_DYNAMIC", "NVFP4A16"]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def dequantized_state(path):
    """The checkpoint's weights in fp32 under transformers' parameter names."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):  # NVFP4: two E2M1 values a byte, the low nibble first
            prefix = name[: -len(".weight_packed")]
            rows, half = t.shape
            nibbles = torch.stack([t & 0xF, t >> 4], dim=-1).reshape(rows, 2 * half).long()
            values = E2M1[nibbles & 0x7] * torch.where(nibbles & 0x8 > 0, -1.0, 1.0)
            scale = tensors[prefix + ".weight_scale"].float() / tensors[prefix + ".weight_global_scale"].float()
            out[prefix + ".weight"] = values * scale.repeat_interleave(2 * half // scale.shape[1], dim=1)
        elif t.dtype == torch.float8_e4m3fn and name.endswith(".weight"):  # FP8: per-channel scales
            out[name] = t.float() * tensors[name[: -len(".weight")] + ".weight_scale"].float()
        elif not name.endswith(("_scale", "_global_scale")) or name.endswith(("router.scale", "per_expert_scale")):
            out.setdefault(name, t.float())
    # Experts fused as transformers holds them: [E, 2I, H] (gate then up) and [E, H, I].
    fused = {}
    for name in list(out):
        if ".experts." in name and name.startswith("model.decoder."):
            layer, rest = name.split(".experts.")
            expert, part = rest.split(".")[:2]
            fused.setdefault(layer, {})[(int(expert), part)] = out.pop(name)
    for layer, parts in fused.items():
        n = 1 + max(e for e, _ in parts)
        out[layer + ".experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
        out[layer + ".experts.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return {k: v for k, v in out.items() if not k.startswith("model.encoder.language_model.") or "layer_scalar" in k}


def reference(path):
    cfg = json.load(open(os.path.join(path, "config.json")))
    config = DiffusionGemmaConfig(text_config=cfg["text_config"], vision_config=cfg["vision_config"],
                                  canvas_length=cfg["canvas_length"])
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    state = dequantized_state(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("vision" in k or k.startswith(("model.encoder.language_model.", "lm_head")) for k in missing), missing
    model.tie_weights()
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_matches_the_dequantized_model(scheme):
    path = os.path.join(FIXTURES, scheme)
    model = ds.Model.load(path)
    assert model.config["quantization"] in ("float-quantized", "nvfp4-pack-quantized")
    seq, ref = model.sequence(), ReferenceSequence(reference(path))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 96, 13)  # past the window of 8
    for s in (seq, ref):
        s.prefill(prompt)
    for block in range(3):
        canvas = rng.integers(0, 96, 8)
        for sc in (None, "previous"):
            expected = ref.denoise(canvas, None if sc is None else previous)
            ours = seq.denoise(canvas, None if sc is None else previous)
            assert np.abs(ours - expected).max() <= 1e-4, f"block {block}"
            assert (ours.argmax(-1) == expected.argmax(-1)).all()
            previous = expected / 0.7
        for s in (seq, ref):
            s.commit(canvas)


def copy_fixture(tmp_path, scheme):
    dst = tmp_path / scheme
    shutil.copytree(os.path.join(FIXTURES, scheme), dst)
    return dst


@pytest.mark.parametrize("field, value, message", [
    ("quant_method", "gptq", "quant_method 'gptq' is not supported"),
    ("format", "int-quantized", "format 'int-quantized' is not supported"),
])
def test_unknown_quantization_is_refused(tmp_path, field, value, message):
    path = copy_fixture(tmp_path, "FP8_DYNAMIC")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"][field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ds.CheckpointError, match=message):
        ds.Model.load(path)


def test_missing_scale_is_named(tmp_path):
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "NVFP4A16")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.decoder.layers.1.mlp.up_proj.weight_global_scale"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match="model.decoder.layers.1.mlp.up_proj.weight_global_scale"):
        ds.Model.load(path)


def test_untied_encoder_copy_is_refused(tmp_path):
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "FP8_DYNAMIC")
    tensors = load_file(path / "model.safetensors")
    name = "model.encoder.language_model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name] * 2
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match="differs from its decoder twin"):
        ds.Model.load(path)


@pytest.mark.parametrize("scheme, library", [("fp8-dynamic", "FP8_DYNAMIC"), ("nvfp4", "NVFP4A16")])
def test_quantize_writes_llm_compressors_bytes(tmp_path, scheme, library):
    """`diffuserve quantize` on the fixtures' fp32 source gives LLM Compressor's tensors, bit for
    bit (it leaves out the encoder's copies of the shared weights), and the same logits."""
    import subprocess
    import sys
    from diffuserve.safetensors_io import read_safetensors
    out = tmp_path / scheme
    subprocess.run([sys.executable, "-m", "diffuserve", "quantize", os.path.join(FIXTURES, "base"), str(out),
                    "--scheme", scheme], check=True)
    ours = read_safetensors(str(out / "model.safetensors"))
    theirs = read_safetensors(os.path.join(FIXTURES, library, "model.safetensors"))
    assert set(ours) == {n for n in theirs if not n.startswith("model.encoder.language_model.")} | \
        {n for n in theirs if n.startswith("model.encoder.language_model.") and n.endswith("layer_scalar")}
    for name, (dtype, values) in ours.items():
        assert theirs[name][0] == dtype, name
        np.testing.assert_array_equal(theirs[name][1], values, err_msg=name)
    canvas = np.arange(8)
    logits = []
    for path in (out, os.path.join(FIXTURES, library)):
        seq = ds.Model.load(path).sequence()
        seq.prefill(np.arange(3, 20))
        logits.append(seq.denoise(canvas))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_quantize_refuses_a_quantized_source(tmp_path):
    from diffuserve.quantize import quantize
    with pytest.raises(ValueError, match="already quantized"):
        quantize(os.path.join(FIXTURES, "FP8_DYNAMIC"), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="scheme 'int8'"):
        quantize(os.path.join(FIXTURES, "base"), str(tmp_path / "y"), "int8")
