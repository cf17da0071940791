"""Quantized checkpoints as LLM Compressor writes them (compressed-tensors FP8 dynamic and
NVFP4, experts stored one linear per expert, encoder copies of the shared weights): the
CPU backend dequantizes the weights and quantizes each linear's input as the config says.
Weight-only NVFP4 must match transformers running the same model with weights dequantized
independently here (torch, from the format's definition); checkpoints that quantize their
activations (FP8 per token, NVFP4 W4A4 with calibrated input global scales) must match the
logits LLM Compressor's own fake-quantized forward gave (reference_logits.safetensors,
written by tests/fixtures/make_quantized.py)."""
import json
import os
import re
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

import diffuserve as ds
from hf_reference import ReferenceSequence

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "quantized")
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
        elif t.dtype == torch.float8_e4m3fn and name.endswith(".weight"):  # FP8: scales per channel or group
            scale = tensors[name[: -len(".weight")] + ".weight_scale"].float().reshape(t.shape[0], -1)
            out[name] = t.float() * scale.repeat_interleave(t.shape[1] // scale.shape[1], dim=1)
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


def assert_matches_the_dequantized_model(path):
    """Over a prompt past the window and three blocks (each denoised without, then with
    self-conditioning, then committed): the logits of transformers on the dequantized
    weights to within 1e-4, and the same argmax everywhere."""
    seq, ref = ds.Model.load(path).sequence(), ReferenceSequence(reference(path))
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


def test_weight_only_nvfp4_matches_the_dequantized_model():
    path = os.path.join(FIXTURES, "NVFP4A16")
    assert ds.Model.load(path).config["quantization"] == "nvfp4-pack-quantized"
    assert_matches_the_dequantized_model(path)


def logits_of(path):
    """diffuserve's logits for a prompt past the window and a denoise, a commit, and a denoise
    with self-conditioning."""
    seq = ds.Model.load(path).sequence()
    rng = np.random.default_rng(0)
    seq.prefill(rng.integers(0, 96, 13))
    first = seq.denoise(rng.integers(0, 96, 8))
    seq.commit(rng.integers(0, 96, 8))
    return np.concatenate([first, seq.denoise(rng.integers(0, 96, 8), first / 0.7)])


def test_fp8_group_scales_match_the_dequantized_model(tmp_path):
    """FP8 weights requantized in groups of 16 inputs, each group's scale its own amax / 448,
    under a config that names no strategy (compressed-tensors infers group from the size):
    transformers on the weights dequantized here. (Weight-only, so that the reference needs
    no fake-quantized activations.)"""
    from safetensors.torch import save_file
    def by_groups(q):
        del q["config_groups"]["group_0"]["weights"]["strategy"]
        q["config_groups"]["group_0"]["weights"]["group_size"] = 16
        q["config_groups"]["group_0"]["input_activations"] = None
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC", by_groups)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if tensors[n].dtype == torch.float8_e4m3fn]:
        rows, cols = tensors[name].shape
        groups = (tensors[name].float() * tensors[name + "_scale"].float()).reshape(rows, cols // 16, 16)
        scale = groups.abs().amax(-1).clamp_min(1e-12) / 448
        tensors[name] = (groups / scale[..., None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale
        assert len(scale.unique()) > rows  # (groups of a row with scales of their own)
    save_file(tensors, path / "model.safetensors")
    assert_matches_the_dequantized_model(path)


@pytest.mark.parametrize("weights", [dict(strategy=None, group_size=-1), dict(strategy="group", group_size=128)],
                         ids=["no strategy, group_size -1: channel", "fewer inputs than a group"])
def test_fp8_scales_a_row_loads_as_the_config_says(tmp_path, weights):
    """The fixture's scales, one a row, under configs that lay them out so: no strategy and a
    group_size of -1 (compressed-tensors infers channel), and groups of 128 over linears of 64
    inputs (one group of them all, as compressed-tensors writes it): the fixture's logits."""
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC",
                                    lambda q: q["config_groups"]["group_0"]["weights"].update(weights))
    assert np.array_equal(logits_of(path), logits_of(os.path.join(FIXTURES, "FP8_DYNAMIC")))


@pytest.mark.parametrize("scheme, edit_weights, edit_scale, message", [
    # Groups of 1 under NVFP4's groups of 16: read by their own shape, they had loaded.
    ("NVFP4A16", None, lambda t: t.view(torch.uint8).repeat_interleave(16, dim=1).contiguous().view(t.dtype),
     r"does not hold the scales quantization_config lays out for a \[\d+, \d+\] weight: \[\d+, \d+\] "
     r"\(groups of 16\)"),
    ("FP8_DYNAMIC", None, lambda t: t.expand(-1, 2).contiguous(),
     r"of shape \[\d+, 2\] does not hold the scales .*: \[\d+\] or \[\d+, 1\] \(strategy channel\)"),
    ("FP8_DYNAMIC", lambda w: w.update(strategy="tensor"), None,
     r"of shape \[\d+, 1\] does not hold the scales .*: one value \(strategy tensor\)"),
    # compressed-tensors' [rows, ceil(cols / group_size)] scales of 64 inputs in groups of 48:
    # read as two groups of 32, the last group's scale had loaded onto half of the first's inputs.
    ("FP8_DYNAMIC", lambda w: w.update(strategy="group", group_size=48), lambda t: t.expand(-1, 2).contiguous(),
     r"scales a weight of 64 inputs, which quantization_config's group_size 48 does not divide"),
], ids=["NVFP4 groups of 1", "FP8 channel as groups", "FP8 tensor as channel", "FP8 partial last group"])
def test_scales_other_than_the_config_lays_out_are_named(tmp_path, scheme, edit_weights, edit_scale, message):
    """A weight's scales must have the shape that its config group's strategy gives them: read
    by their own shape instead, scales in groups of another size had loaded onto the wrong inputs."""
    from safetensors.torch import save_file
    path = edit_quantization_config(tmp_path, scheme, lambda q: edit_weights and edit_weights(
        q["config_groups"]["group_0"]["weights"]))
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight_scale") and edit_scale]:
        tensors[name] = edit_scale(tensors[name])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match=r"'[\w.]+\.weight_scale'.* " + message):
        ds.Model.load(path)


def partly_plain_attention_checkpoint(tmp_path):
    """The weight-only NVFP4 fixture with some of its attention projections stored plainly
    (their dequantized values, fp32), so that each way the runtime multiplies a layer's
    query, key and value linears serves a layer: layer 1 all three plain (one stacked
    product), layer 0 its key and value (one product for the two where the backend can, the
    query's apart), layer 2 (full attention, no v_proj) its query alone (three products)."""
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "NVFP4A16")
    tensors, plain = load_file(path / "model.safetensors"), dequantized_state(path)
    cfg = json.loads((path / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    attention = "model.decoder.layers.{}.self_attn.{}_proj"
    modules = [attention.format(0, p) for p in "kv"] + [attention.format(1, p) for p in "qkv"]
    modules.append(attention.format(2, "q"))
    for module in modules:
        for copy in {module, module.replace("model.decoder.", "model.encoder.language_model.")}:
            if copy + ".weight_packed" not in tensors:
                continue
            for suffix in (".weight_packed", ".weight_scale", ".weight_global_scale"):
                del tensors[copy + suffix]
            tensors[copy + ".weight"] = plain[module + ".weight"].clone()
            ignore.append(copy)  # (stored plainly: the config must leave it so)
    save_file(tensors, path / "model.safetensors")
    cfg["quantization_config"]["ignore"] = ignore
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_partly_plain_attention_projections_match_the_dequantized_model(tmp_path):
    assert_matches_the_dequantized_model(partly_plain_attention_checkpoint(tmp_path))


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "NVFP4"])
def test_matches_llm_compressors_forward(scheme):
    """Over a prompt past the window and three blocks (each denoised without, then with
    self-conditioning, then committed): the logits of LLM Compressor's fake-quantized model,
    the same argmax everywhere, and seven rows in eight within 1e-5 (fp32 rounding: 2e-7
    observed). The rest may be 2e-2 apart: fp32 sums in another order can put one activation
    of a row at the next quantization step. On the FP8 fixture's self-conditioning step,
    diffuserve's own CPU builds (fused multiply-adds or not) put three rows 1e-2 apart, the
    others 1e-7. A quantization done wrong moves every row."""
    path = os.path.join(FIXTURES, scheme)
    ref = load_numpy(os.path.join(path, "reference_logits.safetensors"))
    seq = ds.Model.load(path).sequence()
    seq.prefill(ref["prompt"])
    row_differences = []
    for block, canvas in enumerate(ref["canvases"]):
        for step, sc in enumerate([None, ref["self_conditioning"][block]]):
            ours, expected = seq.denoise(canvas, sc), ref["logits"][block, step]
            row_differences += list(np.abs(ours - expected).max(-1))
            assert (ours.argmax(-1) == expected.argmax(-1)).all(), f"block {block} step {step}"
        seq.commit(canvas)
    row_differences = np.array(row_differences)
    assert (row_differences <= 1e-5).mean() >= 7 / 8, np.sort(row_differences)[::-1][:8]
    assert row_differences.max() <= 2e-2


def test_w4a4_mixed_phase_batches_match_separate_passes():
    """The encoder's rows of a batch take the encoder's input global scales, the decoder's
    rows the decoder's: a commit fused with the next block's first step, and prefill chunks
    batched with other requests' denoising, give the tokens of separate passes."""
    path = os.path.join(FIXTURES, "NVFP4")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 19, 11)]
    params = [ds.SamplingParams(max_new_tokens=24, seed=s, eos_token_id=[], max_denoising_steps=4) for s in range(3)]
    fused = ds.LLM(path, kv_block_size=4, max_num_batched_tokens=24).generate(prompts, params)
    separate = ds.LLM(path, kv_block_size=4, fuse_commit=False)
    for prompt, p, out in zip(prompts, params, fused):
        alone = separate.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids
        assert out.denoise_steps == alone.denoise_steps


def copy_fixture(tmp_path, scheme):
    dst = tmp_path / scheme
    shutil.copytree(os.path.join(FIXTURES, scheme), dst)
    return dst


def edit_quantization_config(tmp_path, scheme, edit):
    """A copy of the fixture whose quantization_config `edit` changes in place."""
    path = copy_fixture(tmp_path, scheme)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def edit_tensor(tmp_path, scheme, name, edit):
    """A copy of the fixture whose tensor `name`, and its encoder copy where stored, are
    replaced by edit(tensor)."""
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, scheme)
    tensors = load_file(path / "model.safetensors")
    twin = name.replace("model.decoder.", "model.encoder.language_model.")
    for n in {name, twin} & tensors.keys():
        tensors[n] = edit(tensors[n])
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("field, value, message", [
    ("quant_method", "gptq", "quant_method 'gptq' is not supported"),
    ("format", "int-quantized", "format 'int-quantized' is not supported"),
])
def test_unknown_quantization_is_refused(tmp_path, field, value, message):
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC", lambda q: q.update({field: value}))
    with pytest.raises(ds.CheckpointError, match=message):
        ds.Model.load(path)


@pytest.mark.parametrize("scheme, name", [
    ("NVFP4A16", "model.decoder.layers.1.mlp.up_proj.weight_global_scale"),
    ("NVFP4", "model.decoder.layers.2.experts.3.down_proj.input_global_scale"),
])
def test_missing_scale_is_named(tmp_path, scheme, name):
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, scheme)
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match=re.escape(name)):
        ds.Model.load(path)


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf"), 1e37, 1e-42])
@pytest.mark.parametrize("scheme, name, message", [
    ("NVFP4A16", "model.decoder.layers.1.mlp.up_proj.weight_global_scale", "positive, finite"),
    ("NVFP4", "model.decoder.layers.2.experts.3.down_proj.input_global_scale", "positive, finite"),
    ("FP8_DYNAMIC", "model.decoder.layers.1.self_attn.q_proj.weight_scale", "must be finite"),
])
def test_bad_scale_is_named(tmp_path, value, scheme, name, message):
    """NVFP4's weights and inputs are divided by their global scales, and FP8's weights are
    multiplied by theirs: a scale that would turn a linear's outputs into NaN or infinity (in
    fp32, at the largest code: E4M3's 448, times E2M1's 6 for NVFP4) is refused at load, named.
    (FP8 scales of 0 or below are numbers: they load.)"""
    path = edit_tensor(tmp_path, scheme, name, lambda t: torch.full_like(t, value))
    x = np.float32(value)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        loads = np.isfinite(x * np.float32(448)) if scheme == "FP8_DYNAMIC" else \
            x > 0 and np.isfinite(x) and np.isfinite(np.float32(6 * 448) / x)
    if loads:
        ds.Model.load(path)
        return
    with pytest.raises(ds.CheckpointError, match=re.escape(name) + ".*" + message):
        ds.Model.load(path)


@pytest.mark.parametrize("scheme, name, edit", [
    ("FP8_DYNAMIC", "model.decoder.layers.1.self_attn.q_proj.weight_scale", lambda t: t.reshape(-1)[:0]),
    ("NVFP4A16", "model.decoder.layers.1.mlp.up_proj.weight_scale", lambda t: t[:, :0]),
    ("NVFP4A16", "model.decoder.layers.1.mlp.up_proj.weight_scale", lambda t: t.T.contiguous()),
], ids=["FP8 empty", "NVFP4 empty rows", "NVFP4 transposed"])
def test_misshapen_scale_is_named(tmp_path, scheme, name, edit):
    """An empty scale (whose group count had been divided by, killing the process) or a
    transposed one (read as rows) is refused at load, named."""
    path = edit_tensor(tmp_path, scheme, name, edit)
    with pytest.raises(ds.CheckpointError, match=re.escape(name) + "' of shape .* does not hold the scales"):
        ds.Model.load(path)


def test_quantized_fused_experts_are_refused(tmp_path):
    """A fused [E, 2I, H] expert stack is no Linear, so compressed-tensors never quantizes it:
    stored as E4M3 with a scale it is refused, named (it had been read as a [E, 2I] weight,
    past the end of its scales)."""
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    path = write_random_checkpoint(tmp_path / "m", canvas_length=8, seed=3)
    name = "model.decoder.layers.0.experts.gate_up_proj"
    tensors = read_safetensors(os.path.join(path, "model.safetensors"))
    shape = tensors[name][1].shape
    tensors[name] = ("F8_E4M3", np.full(shape, 0x38, np.uint8))
    tensors[name + ".weight_scale"] = np.full((shape[0], shape[1], 1), 0.01, np.float32)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with pytest.raises(ds.CheckpointError, match=re.escape(name) + ".* is stored quantized; only a linear's"):
        ds.Model.load(path)


def test_stacked_linears_quantized_differently_are_a_checkpoint_error(tmp_path):
    """Gate and up become one weight: scales of different group sizes (two config groups) are
    the checkpoint's fault, a CheckpointError naming the tensor (it had been a plain ValueError)."""
    from safetensors.torch import save_file
    gate = "model.decoder.layers.1.mlp.gate_proj"
    def by_groups_of_32(q):
        q["config_groups"]["group_1"] = json.loads(json.dumps(q["config_groups"]["group_0"]))
        q["config_groups"]["group_1"]["weights"].update(strategy="group", group_size=32)
        encoder_gate = gate.replace("model.decoder.", "model.encoder.language_model.")
        q["config_groups"]["group_1"]["targets"] = [gate, encoder_gate]
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC", by_groups_of_32)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("layers.1.mlp.gate_proj.weight_scale")]:
        tensors[name] = tensors[name].expand(-1, tensors[name[: -len("_scale")]].shape[1] // 32).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match=r"up_proj.weight': the linears stacked into one weight are quantized "
                                                 r"differently"):
        ds.Model.load(path)


@pytest.mark.parametrize("plain", ["gate_proj", "up_proj"])
def test_a_plain_linear_stacked_with_quantized_ones_is_named(tmp_path, plain):
    """Gate and up run as one weight: one stored plainly beside a quantized one is named as
    such whichever comes first (a plain gate had sent up, FP8, to the plain path's dtype check)."""
    name = f"model.decoder.layers.1.mlp.{plain}.weight"
    path = edit_tensor(tmp_path, "FP8_DYNAMIC", name, lambda t: t.float())
    with pytest.raises(ds.CheckpointError, match=re.escape(name) + "' is stored plainly, but the linears stacked"):
        ds.Model.load(path)


@pytest.mark.parametrize("scheme, name", [
    ("NVFP4A16", "model.decoder.layers.1.mlp.up_proj.weight_scale"),
    ("NVFP4A16", "model.decoder.layers.2.experts.3.down_proj.weight_scale"),
    ("FP8_DYNAMIC", "model.decoder.layers.2.experts.3.down_proj.weight"),
])
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_code_is_named(tmp_path, scheme, name, code):
    """An E4M3 code that is NaN (either sign) is refused at load, named: in an NVFP4 group
    scale its 16 values would be NaN; in an FP8 weight, it had loaded, and the logits were NaN
    at the first denoise, named by no tensor."""
    def one_nan(tensor):
        codes = tensor.view(torch.uint8).clone()
        codes.view(-1)[codes.numel() // 2] = code
        return codes.view(tensor.dtype)
    path = edit_tensor(tmp_path, scheme, name, one_nan)
    with pytest.raises(ds.CheckpointError, match=re.escape(name) + "' holds NaN"):
        ds.Model.load(path)


def activations(**args):
    """input_activations: FP8_DYNAMIC's, with `args` changed."""
    return dict(dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True, group_size=None), **args)


@pytest.mark.parametrize("args, named", [
    (activations(strategy="tensor", dynamic=False), "static tensor 8-bit float"),
    (activations(symmetric=False), "asymmetric dynamic token 8-bit float"),
    (activations(type="int"), "dynamic token 8-bit int"),
    (activations(num_bits=4), "dynamic token 4-bit float"),
    (activations(num_bits=4, strategy="tensor_group", group_size=32, dynamic="local"),
     "local dynamic tensor_group of 32 4-bit float"),
])
def test_unsupported_activation_scheme_is_named(tmp_path, args, named):
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC",
                                    lambda q: q["config_groups"]["group_0"].update(input_activations=args))
    with pytest.raises(ds.CheckpointError, match=re.escape(
            f"quantization_config.config_groups.group_0.input_activations = {named} is not supported")):
        ds.Model.load(path)


@pytest.mark.parametrize("scheme, edit, message", [
    ("NVFP4", lambda q: q["config_groups"]["group_0"].update(output_activations=activations()),
     "config_groups.group_0.output_activations is not supported"),
    ("NVFP4", lambda q: q.update(kv_cache_scheme=activations(strategy="tensor", dynamic=False)),
     "quantization_config.kv_cache_scheme is not supported"),
    ("FP8_DYNAMIC", lambda q: q.update(ignore=[n for n in q["ignore"] if "decoder.layers.1.router" not in n]),
     "quantizes the input of 'model.decoder.layers.1.router.proj'"),
    # A regex target outranks the class "Linear": up_proj's input would be left unquantized, gate_proj's not.
    ("NVFP4", lambda q: q["config_groups"].update(group_1=dict(targets=["re:.*decoder.layers.0.mlp.up_proj$"],
                                                               weights=q["config_groups"]["group_0"]["weights"])),
     "quantizes the inputs of 'model.decoder.layers.0.mlp.gate_proj' and 'model.decoder.layers.0.mlp.up_proj' "
     "differently"),
    ("NVFP4", lambda q: q["config_groups"].update(group_1=dict(targets=["Linear"])),
     "names 'Linear', which another config group also targets"),
    # Settings that change what the stored weights mean, which had been ignored (the logits those
    # of the plain reading).
    ("NVFP4", lambda q: q.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
     "quantization_config.transform_config is not supported"),
    ("NVFP4", lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
     "quantization_config.sparsity_config is not supported"),
    ("NVFP4", lambda q: q.update(quantization_status="frozen"), "quantization_status 'frozen' is not supported"),
    ("NVFP4", lambda q: q["config_groups"]["group_0"].update(format="float-quantized"),
     "config_groups.group_0.format 'float-quantized' differs from quantization_config.format"),
    ("FP8_DYNAMIC", lambda q: q["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4, group_size=128,
                                                                              strategy="group", symmetric=False),
     "config_groups.group_0.weights = asymmetric group of 128 4-bit int does not go with format 'float-quantized'"),
    ("NVFP4", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32),
     "weights = tensor_group of 32 4-bit float does not go with format 'nvfp4-pack-quantized'"),
    # Groups without their size, which compressed-tensors refuses (it had loaded, the scales'
    # shape taken for the groups).
    ("FP8_DYNAMIC", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"),
     "config_groups.group_0.weights.group_size must be a positive number of inputs for strategy 'group'"),
    ("NVFP4", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=None),
     "weights.group_size must be a positive number of inputs for strategy 'tensor_group'"),
    ("FP8_DYNAMIC", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16),
     "config_groups.group_0.weights.group_size = 16 goes with strategy group or tensor_group, not 'channel'"),
    ("FP8_DYNAMIC", lambda q: q.update(format="nvfp4-pack-quantized") or q["config_groups"]["group_0"].update(
        format="nvfp4-pack-quantized", weights={"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                "group_size": 16, "symmetric": True}, input_activations=None),
     "is stored as FP8 (F8_E4M3), but quantization_config.format is 'nvfp4-pack-quantized'"),
    # A linear stored quantized that the config leaves plain (had loaded, dequantized).
    ("FP8_DYNAMIC", lambda q: q["ignore"].append(r"re:.*decoder\.layers\.0\.mlp\.down_proj\Z"),
     "'model.decoder.layers.0.mlp.down_proj.weight' is stored quantized (F8_E4M3, or NVFP4's weight_packed), but "
     "quantization_config leaves 'model.decoder.layers.0.mlp.down_proj' unquantized"),
    # The encoder's copies matched by their own names (they had taken the decoder's scheme).
    ("FP8_DYNAMIC", lambda q: q["ignore"].append(r"re:model\.encoder\.language_model\..*mlp\.down_proj"),
     "quantizes 'model.decoder.layers.0.mlp.down_proj' and its encoder copy "
     "'model.encoder.language_model.layers.0.mlp.down_proj' differently"),
    # A pattern std::regex would compile by recursion past the stack (it had been a segfault).
    ("FP8_DYNAMIC", lambda q: q["ignore"].append("re:" + "(" * 20000 + "a" + ")" * 20000),
     "is longer than 1024 characters or nests groups deeper than 32"),
    ("FP8_DYNAMIC", lambda q: q["ignore"].append("re:" + "(" * 33 + "a" + ")" * 33),
     "nests groups deeper than 32"),
    # A back-reference, which the matcher's polynomial mode does not take (libstdc++ 13's own
    # refusal crashed the process: it is refused before the regex is built).
    ("FP8_DYNAMIC", lambda q: q["ignore"].append(r"re:(a)\1"), "holds a back-reference"),
    ("FP8_DYNAMIC", lambda q: q["ignore"].append(r"re:(?<x>a)\k<x>"), "holds a back-reference"),
    ("FP8_DYNAMIC", lambda q: q["ignore"].append("re:(a"), "'re:(a' is not a regular expression this runtime reads"),
    ("FP8_DYNAMIC", lambda q: q["ignore"].append("re:[b-a]"), "is not a regular expression this runtime reads"),
    # The tied head quantized (lm_head taken out of ignore): its input had silently stayed plain.
    ("FP8_DYNAMIC", lambda q: q["ignore"].remove("lm_head"),
     "quantization_config quantizes 'lm_head' (not in its ignore), but the head is tied to the embedding"),
    # The input of a router's encoder copy quantized, the decoder's left plain: it had loaded,
    # the encoder's copy run on plain inputs.
    ("FP8_DYNAMIC",
     lambda q: q.update(ignore=[n for n in q["ignore"] if "encoder.language_model.layers.1.router" not in n]),
     "quantizes the input of 'model.encoder.language_model.layers.1.router.proj'"),
    # FP8_BLOCK, named by its weights (its activations' groups of 128 had been named first).
    ("FP8_DYNAMIC", lambda q: q["config_groups"]["group_0"].update(
        weights=dict(q["config_groups"]["group_0"]["weights"], strategy="block", block_structure=[128, 128]),
        input_activations=dict(q["config_groups"]["group_0"]["input_activations"], strategy="group", group_size=128)),
     "config_groups.group_0.weights.block_structure is not supported"),
])
def test_unsupported_quantization_config_is_refused(tmp_path, scheme, edit, message):
    path = edit_quantization_config(tmp_path, scheme, edit)
    with pytest.raises(ds.CheckpointError, match=re.escape(message)):
        ds.Model.load(path)


@pytest.mark.parametrize("modules", [["model.decoder.layers.1.self_attn.o_proj"],
                                     ["model.decoder.self_conditioning.gate_proj",
                                      "model.decoder.self_conditioning.up_proj"],
                                     [f"model.decoder.layers.2.experts.{e}.down_proj" for e in range(4)]],
                         ids=["linear", "stacked", "experts"])
def test_a_plain_linear_that_the_config_quantizes_is_named(tmp_path, modules):
    """Linears stored plainly (their dequantized values, their scales gone: a dequantized export
    that kept its quantization_config) where the config quantizes them: they had loaded, their
    input quantized as the FP8 weights' are."""
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "FP8_DYNAMIC")
    tensors = load_file(path / "model.safetensors")
    assert "model.decoder.layers.2.experts.4.down_proj.weight" not in tensors  # (the fixture's 4 experts)
    for module in modules:
        for copy in {module, module.replace("model.decoder.", "model.encoder.language_model.")}:
            if copy + ".weight" in tensors:
                scale = tensors.pop(copy + ".weight_scale").float()
                tensors[copy + ".weight"] = tensors[copy + ".weight"].float() * scale
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match=re.escape(
            f"'{modules[0]}.weight' is stored unquantized, but quantization_config quantizes '{modules[0]}'")):
        ds.Model.load(path)


def test_fp8_weights_labelled_naive_quantized_load_as_float_quantized_ones(tmp_path):
    """FP8 weights whose inputs stay plain (W8A16), which compressed-tensors labels
    naive-quantized (float-quantized needs input activations): the same tensors, the same
    logits as under the float-quantized label (the format had been refused)."""
    def weight_only(label):
        def edit(q):
            q["format"] = q["config_groups"]["group_0"]["format"] = label
            q["config_groups"]["group_0"]["input_activations"] = None
        return edit_quantization_config(tmp_path / label, "FP8_DYNAMIC", edit)
    assert np.array_equal(logits_of(weight_only("naive-quantized")), logits_of(weight_only("float-quantized")))


def test_a_quantized_head_under_a_tied_config_runs_untied(tmp_path):
    """lm_head stored quantized (NVFP4, the config's ignore not naming it) under
    tie_word_embeddings true: the stored head runs, as for a head stored with other values than
    the embedding, with the same logits as under tie_word_embeddings false (it had been refused
    as a tied head whose embedding is stored unquantized)."""
    from diffuserve.quantize import _absmax, _nvfp4_linear
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    paths = []
    for tie in (True, False):
        path = edit_quantization_config(tmp_path / str(tie), "NVFP4A16", lambda q: q["ignore"].remove("lm_head"))
        cfg = json.loads((path / "config.json").read_text())
        cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = tie
        (path / "config.json").write_text(json.dumps(cfg))
        tensors = read_safetensors(os.path.join(path, "model.safetensors"))
        embedding = tensors["model.decoder.embed_tokens.weight"][1].astype(np.float32)
        packed, scale, global_scale = _nvfp4_linear(embedding, _absmax(embedding))
        tensors.update({"lm_head.weight_packed": packed, "lm_head.weight_scale": scale,
                        "lm_head.weight_global_scale": global_scale})
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        paths.append(path)
    assert np.array_equal(logits_of(paths[0]), logits_of(paths[1]))


def test_a_scale_beside_a_plain_weight_is_named_as_one(tmp_path):
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "NVFP4A16")
    tensors = load_file(path / "model.safetensors")
    name = "model.decoder.layers.0.self_attn.q_norm.weight_scale"
    tensors[name] = torch.ones(1)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ds.CheckpointError, match=re.escape(f"unexpected tensor '{name}': a quantization parameter")):
        ds.Model.load(path)


def test_a_quantized_base_models_config_names_its_modules_without_model(tmp_path):
    """A base model's checkpoint (DiffusionGemmaModel's tensors, without "model."), whose ignore
    list names its modules as LLM Compressor matched them there: the same logits as the full
    model's (its exact names had been matched only in the "model." form, so that its routers'
    inputs were taken as quantized and the load refused)."""
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "FP8_DYNAMIC")
    tensors = load_file(path / "model.safetensors")
    save_file({n.removeprefix("model."): t for n, t in tensors.items() if n != "lm_head.weight"},
              path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    q = cfg["quantization_config"]
    q["ignore"] = [n.removeprefix("model.") for n in q["ignore"] if n != "lm_head"]  # (a base model has none)
    (path / "config.json").write_text(json.dumps(cfg))
    assert np.array_equal(logits_of(path), logits_of(os.path.join(FIXTURES, "FP8_DYNAMIC")))


def test_a_backtracking_pattern_matches_in_polynomial_time(tmp_path):
    """A target or ignore pattern that a backtracking matcher takes exponential time over
    (nested alternatives under a star) loads at once: the load had never ended. In a child
    process, so that a regression fails by its timeout rather than hanging the tests."""
    import subprocess
    import sys
    path = edit_quantization_config(tmp_path, "FP8_DYNAMIC", lambda q: q["ignore"].append("re:(.|.)*X"))
    code = f"import diffuserve as ds; ds.Model.load({str(path)!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_encoder_copy_of_other_values_is_the_encoders_own(tmp_path):
    """A tied checkpoint whose encoder copy of a decoder weight holds other values: transformers
    leaves that pair untied (warning that the config is wrong) and runs the encoder on the copy,
    and so does diffuserve (it had refused the checkpoint). The prompt's keys and values are
    then those of a checkpoint where both copies hold the new values, and the canvas's logits
    those of the decoder's own."""
    from safetensors.torch import save_file
    name = "model.decoder.layers.0.mlp.down_proj.weight_scale"
    twin = name.replace("model.decoder.", "model.encoder.language_model.")
    tensors = load_file(os.path.join(FIXTURES, "FP8_DYNAMIC", "model.safetensors"))
    assert torch.equal(tensors[name], tensors[twin])
    prompt, canvas = np.arange(6, dtype=np.int32) + 7, np.arange(8, dtype=np.int32) % 5 + 3

    def run(decoder_scale, encoder_scale):
        path = copy_fixture(tmp_path / f"{decoder_scale}-{encoder_scale}", "FP8_DYNAMIC")
        edited = {**tensors, name: tensors[name] * decoder_scale, twin: tensors[twin] * encoder_scale}
        save_file(edited, path / "model.safetensors")
        seq = ds.Model.load(path).sequence()
        seq.prefill(prompt)
        return [seq.kv(layer) for layer in range(2)], seq.denoise(canvas, None)

    base_kv, base_logits = run(1, 1)
    apart_kv, apart_logits = run(1, 2)
    both_kv, both_logits = run(2, 2)
    for apart, both, base in zip(apart_kv, both_kv, base_kv):
        for a, b in zip(apart, both):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(apart_kv[1][0], base_kv[1][0])  # (layer 0's MLP feeds layer 1's keys)
    assert not np.array_equal(apart_logits, both_logits)
    assert not np.array_equal(apart_logits, base_logits)


def test_encoder_copy_of_equal_values_in_another_dtype_is_taken(tmp_path):
    """A tied checkpoint's encoder copy may be stored in another dtype (fp32 beside bf16): the
    same values, so the same model, as transformers (which ties and skips the copy) loads it."""
    from safetensors.torch import save_file
    path = copy_fixture(tmp_path, "FP8_DYNAMIC")
    tensors = load_file(path / "model.safetensors")
    name = "model.decoder.layers.0.mlp.down_proj.weight_scale"
    twin = name.replace("model.decoder.", "model.encoder.language_model.")
    tensors[name] = tensors[name].bfloat16().float()  # values a bf16 copy holds exactly
    tensors[twin] = tensors[name].clone()
    save_file(tensors, path / "model.safetensors")
    canvas = np.arange(8, dtype=np.int32) % 5 + 3
    seq = ds.Model.load(path).sequence()
    seq.prefill(np.arange(4, dtype=np.int32) + 7)
    expected = seq.denoise(canvas, None)
    tensors[twin] = tensors[name].bfloat16()
    save_file(tensors, path / "model.safetensors")
    seq = ds.Model.load(path).sequence()
    seq.prefill(np.arange(4, dtype=np.int32) + 7)
    np.testing.assert_array_equal(seq.denoise(canvas, None), expected)


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


def test_quantize_quantizes_an_untied_encoders_own_linears(tmp_path):
    """A source whose encoder has weights of its own (tie_word_embeddings false): its linears
    are quantized as the decoder's are, as LLM Compressor quantizes every Linear (they had been
    written unquantized, under a config that says they are)."""
    from diffuserve.quantize import quantize
    from diffuserve.safetensors_io import read_safetensors
    from hf_reference import F, S, build_model, save, text
    src = save(build_model(text([S, F], hidden_size=64), 8, tie_word_embeddings=False), tmp_path / "src")
    quantize(str(src), str(tmp_path / "q"), "fp8-dynamic")
    tensors = read_safetensors(str(tmp_path / "q" / "model.safetensors"))
    for half in ("model.decoder.", "model.encoder.language_model."):
        for linear in ("self_attn.q_proj", "mlp.down_proj", "experts.1.up_proj"):
            name = f"{half}layers.1.{linear}.weight"
            assert tensors[name][0] == "F8_E4M3" and name + "_scale" in tensors, name
    seq = ds.Model.load(str(tmp_path / "q")).sequence()
    seq.prefill(np.arange(3, 12))
    assert np.isfinite(seq.denoise(np.arange(8))).all()


def untied_source(path, mlp_copies=False, all_copies=False):
    """A tie_word_embeddings-false source whose encoder has weights of its own, or copies of the
    decoder's for its MLPs, or for everything: its layer scalars stay its own (transformers
    never ties those buffers)."""
    from hf_reference import F, S, build_model, save, text
    model = build_model(text([S, F], hidden_size=64), 8, tie_word_embeddings=False)
    encoder, decoder = model.model.encoder.language_model, model.model.decoder
    with torch.no_grad():
        for mine, theirs in zip(encoder.layers, decoder.layers):
            if all_copies or mlp_copies:
                mine.mlp.load_state_dict(theirs.mlp.state_dict())
            if all_copies:
                scalar = mine.layer_scalar.clone()
                mine.load_state_dict(theirs.state_dict())
                mine.layer_scalar.copy_(scalar)
        if all_copies:
            encoder.embed_tokens.load_state_dict(decoder.embed_tokens.state_dict())
            encoder.norm.load_state_dict(decoder.norm.state_dict())
    return str(save(model, path))


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4"])
def test_quantized_untied_encoder_takes_the_decoders_copies(tmp_path, scheme):
    """quantize leaves out an untied encoder's copies of the decoder's weights; the load then
    takes the decoder's for them: the same logits as the checkpoint with the copies written
    out (it had refused the checkpoint: "missing tensor"). An encoder that is all copies but
    its layer scalars is one set of weights with the decoder's."""
    from diffuserve.quantize import quantize
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    E, D = "model.encoder.language_model.", "model.decoder."
    for name, copies in (("mlp", dict(mlp_copies=True)), ("all", dict(all_copies=True))):
        out = str(tmp_path / f"{name}_q")
        quantize(untied_source(tmp_path / name, **copies), out, scheme)
        path = os.path.join(out, "model.safetensors")
        tensors = read_safetensors(path)
        assert not any(n.startswith(E + "layers.0.mlp.") for n in tensors)
        seq = ds.Model.load(out).sequence()
        seq.prefill(np.arange(3, 12))
        logits = seq.denoise(np.arange(8))
        assert np.isfinite(logits).all()
        # The same checkpoint with the decoder's copies written out under the encoder's names.
        tensors.update({E + n[len(D):]: t for n, t in list(tensors.items())
                        if n.startswith(D) and not n.startswith(D + "self_conditioning") and E + n[len(D):] not in tensors})
        write_safetensors(path, tensors)
        seq = ds.Model.load(out).sequence()
        seq.prefill(np.arange(3, 12))
        assert np.array_equal(seq.denoise(np.arange(8)), logits), name


@pytest.mark.parametrize("plain", ["encoder", "decoder"])
def test_untied_encoder_quantized_its_own_way(tmp_path, plain):
    """An untied encoder and the decoder quantized differently (the config's ignore names the
    plain one): each set is quantized as the config says of it, the encoder's keys and values
    those of the checkpoint that stores its linears alike (a plain encoder had been refused:
    "quantizes ... and its encoder copy ... differently"; a quantized one is not taken for the
    plain decoder's, whose names its packed weights lack)."""
    from diffuserve.quantize import quantize
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    side = {"encoder": "model.encoder.language_model.", "decoder": "model.decoder."}[plain]
    src, out = untied_source(tmp_path / "src"), str(tmp_path / "q")
    quantize(src, out, "nvfp4")
    same_encoder = src if plain == "encoder" else str(tmp_path / "all")
    shutil.copytree(out, tmp_path / "all")
    plain_tensors, path = read_safetensors(os.path.join(src, "model.safetensors")), os.path.join(out, "model.safetensors")
    tensors = {n: t for n, t in read_safetensors(path).items() if not n.startswith(side)}
    write_safetensors(path, {**tensors, **{n: t for n, t in plain_tensors.items() if n.startswith(side)}})
    config = json.loads(open(os.path.join(out, "config.json")).read())
    config["quantization_config"]["ignore"].append("re:" + side.replace(".", "\\.") + ".*")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    seqs = [ds.Model.load(p).sequence() for p in (same_encoder, out)]
    for seq in seqs:
        seq.prefill(np.arange(3, 12))
    for layer in range(2):
        for a, b in zip(seqs[0].kv(layer)[:2], seqs[1].kv(layer)[:2]):
            np.testing.assert_array_equal(a, b)
    assert np.isfinite(seqs[1].denoise(np.arange(8))).all()


def test_quantize_refuses_a_quantized_source(tmp_path):
    from diffuserve.quantize import quantize
    with pytest.raises(ValueError, match="already quantized"):
        quantize(os.path.join(FIXTURES, "FP8_DYNAMIC"), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="scheme 'int8'"):
        quantize(os.path.join(FIXTURES, "base"), str(tmp_path / "y"), "int8")


@pytest.mark.parametrize("scheme", ["NVFP4A16", "FP8_DYNAMIC"])
def test_quantize_refuses_a_quantized_source_whose_config_says_nothing(tmp_path, scheme):
    """A quantized checkpoint whose config.json lost its quantization_config: NVFP4's packed
    weights and scales had been copied through, into a copy that the load refused."""
    from diffuserve.quantize import quantize
    src = copy_fixture(tmp_path, scheme)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"is F8_E4M3; a weight to quantize|\) is a quantization parameter"):
        quantize(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("field, tensor", [("moe_intermediate_size", r"model\.decoder\.layers\.\d+\.experts\.down_proj"),
                                           ("hidden_size", r"model\.decoder\.[\w.]+\.weight")])
def test_quantize_nvfp4_refuses_inputs_not_in_groups_of_16_naming_the_stored_tensor(tmp_path, field, tensor):
    """NVFP4's scales cover 16 inputs: a linear of another input size is refused before anything
    is written, naming the source and the tensor as stored (an expert stack, where it had named
    one expert's linear, which the source does not hold); FP8 takes it."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, **{field: 40})
    with pytest.raises(ValueError, match=re.escape(f"{src}: tensor '") + tensor + re.escape(
            "' has 40 inputs; nvfp4 needs every linear's input size to be a multiple of 16")):
        quantize(src, str(tmp_path / "nvfp4"), "nvfp4")
    assert not os.path.exists(tmp_path / "nvfp4")
    quantize(src, str(tmp_path / "fp8"), "fp8-dynamic")
    sequence = ds.Model.load(str(tmp_path / "fp8")).sequence()
    sequence.prefill([3, 4, 5])
    assert np.isfinite(sequence.denoise(np.arange(8))).all()


def test_quantize_refuses_a_source_with_kv_cache_scales(tmp_path):
    """A KV cache's scales (compressed-tensors' kv_cache_scheme) in a source whose config says
    nothing of them: refused, not copied into a copy that the load refuses."""
    from diffuserve.quantize import quantize
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    src = copy_fixture(tmp_path, "base")
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    tensors["model.decoder.layers.0.self_attn.k_scale"] = ("F32", np.ones(1, np.float32))
    write_safetensors(os.path.join(src, "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"self_attn.k_scale' \(F32\) is a quantization parameter: the source"):
        quantize(str(src), str(tmp_path / "out"))


@pytest.mark.parametrize("inside", [".", "quantized", "additional_chat_templates/quantized", "link/quantized"])
def test_quantize_refuses_a_destination_inside_its_source(tmp_path, inside):
    from diffuserve.quantize import quantize
    src = copy_fixture(tmp_path, "base")
    (tmp_path / "link").symlink_to(src)
    with pytest.raises(ValueError, match="the output directory is (the|inside the) source"):
        quantize(str(src), str(src / inside) if inside != "link/quantized" else str(tmp_path / inside))
    assert sorted(os.listdir(src)) == sorted(os.listdir(os.path.join(FIXTURES, "base")))


def test_quantize_refuses_bytes_no_tensor_claims(tmp_path):
    """A safetensors source whose header leaves data bytes to no tensor (an entry missing) is
    refused naming them, as the loader refuses it (test_errors.py)."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    path = os.path.join(src, "model.safetensors")
    with open(path, "ab") as f:
        f.write(bytes(8))
    with pytest.raises(ValueError, match=r"bytes \[\d+, \d+\) at its end belong to no tensor"):
        quantize(src, str(tmp_path / "out"))


def _shard(src, shards, stale=()):
    """Splits src's model.safetensors into len(shards) files named `shards` with an index naming
    them (tensors dealt round them), then writes each of `stale` as a shard no index names,
    holding the first tensor again (an earlier save's leftover)."""
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    single = os.path.join(src, "model.safetensors")
    tensors = read_safetensors(single)
    os.remove(single)
    names = sorted(tensors)
    weight_map = {}
    for i, shard in enumerate(shards):
        part = {n: tensors[n] for n in names[i::len(shards)]}
        write_safetensors(os.path.join(src, shard), part)
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for shard in stale:
        write_safetensors(os.path.join(src, shard), {names[0]: tensors[names[0]]})


def test_quantize_reads_the_models_weight_files_alone(tmp_path):
    """`quantize` reads the files a load reads: model.safetensors, else the index's shards. Any
    other .safetensors file beside them (a test's reference logits, an earlier save's shards)
    is not the model's: it had been merged in, and the copy then failed to load ("unexpected
    tensor")."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    clean = write_random_checkpoint(tmp_path / "clean", canvas_length=8, seed=3, hidden_size=64)
    quantize(clean, str(tmp_path / "clean_q"))
    expected = read_safetensors(str(tmp_path / "clean_q" / "model.safetensors"))

    stray = shutil.copytree(clean, tmp_path / "stray")
    write_safetensors(os.path.join(stray, "reference_logits.safetensors"), {"logits": np.zeros((4, 4), np.float32)})
    sharded = shutil.copytree(clean, tmp_path / "sharded")
    _shard(sharded, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
           stale=["model-00001-of-00003.safetensors"])
    for src in (stray, sharded):
        out = str(tmp_path / (os.path.basename(src) + "_q"))
        quantize(str(src), out)
        got = read_safetensors(os.path.join(out, "model.safetensors"))
        assert set(got) == set(expected)
        for name, (dtype, values) in got.items():
            assert expected[name][0] == dtype, name
            np.testing.assert_array_equal(expected[name][1], values, err_msg=name)
        ds.Model.load(out)


def test_quantize_failing_midway_leaves_no_checkpoint(tmp_path, monkeypatch):
    """A tensor that fails as the output is written (it had been a truncated model.safetensors,
    which a second run then refused as a checkpoint already there) leaves nothing behind; and a
    0-d tensor passes through (the lazy writer had refused it)."""
    from diffuserve import quantize as q
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    tensors["model.encoder.vision_tower.scale"] = ("BF16", np.array(16256, np.uint16))  # 1.0, shape ()
    write_safetensors(os.path.join(src, "model.safetensors"), tensors)

    def failing(w):
        raise RuntimeError("no")
    monkeypatch.setattr(q, "_fp8_linear", failing)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="no"):
        q.quantize(src, str(out))
    assert not out.exists()  # (the folder it made goes too)
    monkeypatch.undo()
    q.quantize(src, str(out))
    assert read_safetensors(str(out / "model.safetensors"))["model.encoder.vision_tower.scale"][1].shape == ()
    ds.Model.load(str(out))


@pytest.mark.parametrize("layout", ["encoder copies", "base model names"])
def test_quantize_writes_what_it_reads_as_a_load_reads_it(tmp_path, layout):
    """A checkpoint that holds the encoder's copies of the decoder's weights (an untied lm_head's,
    as transformers saves it), or names its tensors without "model." (a base model's save):
    `quantize` writes the same tensors as from the plain checkpoint, under the names it read.
    (The encoder's experts had been quantized and its linears not, and the copy failed to load;
    a base model's linears had been left unquantized.)"""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    clean = write_random_checkpoint(tmp_path / "clean", canvas_length=8, seed=3, hidden_size=64)
    quantize(clean, str(tmp_path / "clean_q"))
    expected = read_safetensors(str(tmp_path / "clean_q" / "model.safetensors"))
    src = shutil.copytree(clean, tmp_path / "src")
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    decoder, encoder = "model.decoder.", "model.encoder.language_model."
    if layout == "encoder copies":
        tensors.update({encoder + n[len(decoder):]: v for n, v in tensors.items()
                        if n.startswith(decoder + "layers.") and encoder + n[len(decoder):] not in tensors})
        renamed = lambda name: name  # noqa: E731
    else:
        tensors = {n[len("model."):]: v for n, v in tensors.items()}
        renamed = lambda name: name[len("model."):]  # noqa: E731
    write_safetensors(os.path.join(src, "model.safetensors"), tensors)
    out = str(tmp_path / "out")
    quantize(str(src), out)
    got = read_safetensors(os.path.join(out, "model.safetensors"))
    assert set(got) == {renamed(n) for n in expected}
    for name, (dtype, values) in expected.items():
        assert got[renamed(name)][0] == dtype, name
        np.testing.assert_array_equal(got[renamed(name)][1], values, err_msg=name)
    ds.Model.load(out)


def test_quantize_checks_the_index_as_the_loader_does(tmp_path):
    """The loader's own checks choose and check the files (one piece of code for both): a
    tensor in two shards (which copy is the model's is unknown), a shard outside the directory,
    a tensor listed under a shard that lacks it, and an index naming no tensor are refused."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    _shard(src, ["a.safetensors", "b.safetensors"], stale=["c.safetensors"])
    index = os.path.join(src, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)

    def refused(weight_map, message):
        with open(index, "w") as f:
            json.dump({**data, "weight_map": weight_map}, f)
        with pytest.raises(ValueError, match=message):
            quantize(src, str(tmp_path / "out"))

    refused({**data["weight_map"], "extra.name": "c.safetensors"}, "is stored in both")  # c repeats a's first
    for shard in ["../elsewhere.safetensors", "x/../a.safetensors", "/abs.safetensors"]:
        refused({**data["weight_map"], "extra.name": shard}, re.escape(f"names '{shard}', which is not a file inside"))
    refused({**data["weight_map"], "extra.name": "a.safetensors"},
            "tensor 'extra.name' is listed in weight_map under a.safetensors but that shard does not contain it")
    refused({}, "holds no tensors")


def test_quantize_keeps_the_named_chat_templates(tmp_path):
    """The copy carries additional_chat_templates/ with the top-level tokenizer files: without
    it a request naming a template (or sending tools, where a tool_use template exists) got
    the default template in the quantized copy. Other folders stay behind."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    os.makedirs(os.path.join(src, "additional_chat_templates"))
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with open(os.path.join(src, "additional_chat_templates", "tool_use.jinja"), "w") as f:
        f.write(template)
    os.makedirs(os.path.join(src, "original"))
    with open(os.path.join(src, "original", "consolidated.bin"), "wb") as f:
        f.write(bytes(16))
    with open(os.path.join(src, "chat_template.jinja"), "w") as f:
        f.write("default")
    out = tmp_path / "out"
    quantize(src, str(out))
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == template
    assert (out / "chat_template.jinja").read_text() == "default"
    assert not (out / "original").exists()


def _header_entry(raw, **fields):
    """safetensors bytes `raw` with fields of its first tensor's header entry replaced."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    first = min(name for name in header if name != "__metadata__")
    header[first] = {**header[first], **fields}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + raw[8 + n:]


@pytest.mark.parametrize("corrupt, message", [
    (lambda raw: b"", "file is 0 bytes, too short for a safetensors header"),
    (lambda raw: struct.pack("<Q", len(raw)) + raw[8:], "bad header length"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "header: invalid JSON at byte"),  # the loader checks the files first
    (lambda raw: _header_entry(raw, dtype="F99"), "unknown dtype 'F99'"),
    (lambda raw: _header_entry(raw, shape=[3, 3]), "needs 36 bytes but data_offsets give"),
    (lambda raw: raw[:-4], "run past the end of the data section"),
], ids=["empty", "header length past the end", "header not JSON", "unknown dtype", "shape vs bytes", "truncated"])
def test_quantize_names_a_malformed_source(tmp_path, corrupt, message):
    """A malformed safetensors source is a ValueError naming the file and what is wrong, which the
    CLI prints as one line (these had been a struct.error, a KeyError, an AttributeError or a
    nonsense byte range, some of them tracebacks from `diffuserve quantize`)."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    path = os.path.join(src, "model.safetensors")
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(corrupt(raw))
    with pytest.raises(ValueError, match=re.escape(path) + ".*" + re.escape(message)):
        quantize(src, str(tmp_path / "out"))


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1]", "top level must be a JSON object")])
def test_quantize_names_a_malformed_config(tmp_path, text, message):
    """json's own error names no file, and a list had no .get (a traceback from the CLI)."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=re.escape(os.path.join(src, "config.json") + ": " + message)):
        quantize(src, str(tmp_path / "out"))


GATE_UP = "model.decoder.layers.0.experts.gate_up_proj"
Q_PROJ = "model.decoder.layers.0.self_attn.q_proj.weight"


def _bf16(values):
    from diffuserve.safetensors_io import bf16_bits
    return "BF16", bf16_bits(np.asarray(values, np.float32))


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4"])
@pytest.mark.parametrize("name, edit, message", [
    (GATE_UP, lambda t: (t[0], t[1].reshape(t[1].shape[0], -1)),
     r"has shape \[\d+, \d+\], expected \[experts, 2 x rows"),
    (GATE_UP, lambda t: (t[0], np.concatenate([t[1], t[1][:, :1]], axis=1)), r"has shape \[\d+, \d+, \d+\], expected"),
    (Q_PROJ, lambda t: (t[0], t[1].reshape(-1)), r"has shape \[\d+\], expected \[out, in\]"),
    (Q_PROJ, lambda t: ("F64", t[1].astype(np.float64)), "is F64; a weight to quantize is F32, F16 or BF16"),
    (Q_PROJ, lambda t: _bf16(np.where(np.arange(t[1].size).reshape(t[1].shape) == 7, np.nan, 0.01)),
     "holds NaN or infinite values"),
    (GATE_UP, lambda t: _bf16(np.where(np.arange(t[1].size).reshape(t[1].shape) == 9, -np.inf, 0.01)),
     "holds NaN or infinite values"),
], ids=["experts 2-d", "experts of odd height", "linear 1-d", "f64", "nan", "inf"])
def test_quantize_names_a_weight_it_cannot_quantize(tmp_path, scheme, name, edit, message):
    """A source weight of a shape the quantized copy cannot be cut from, of a dtype that is no
    float, or holding NaN or infinities is a ValueError naming it, and nothing is written (a
    2-D experts tensor had been an IndexError; an odd-height stack of gate and up had lost a
    row and loaded; NVFP4 had dropped a NaN from its scales and written a model that ran)."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    from diffuserve.safetensors_io import read_safetensors, write_safetensors
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64, intermediate_size=64,
                                  moe_intermediate_size=32)
    path = os.path.join(src, "model.safetensors")
    tensors = read_safetensors(path)
    dtype, arr = edit(tensors[name])
    tensors[name] = (dtype, np.ascontiguousarray(arr))
    write_safetensors(path, tensors)
    out = tmp_path / "new" / "out"
    with pytest.raises(ValueError, match=re.escape(f"{src}: tensor '{name}' ") + message):
        quantize(src, str(out), scheme)
    assert not (tmp_path / "new").exists()  # (the folders it had made stayed behind, empty)
    out.mkdir(parents=True)
    with pytest.raises(ValueError, match=re.escape(f"{src}: tensor '{name}' ") + message):
        quantize(src, str(out), scheme)
    assert out.is_dir() and not os.listdir(out)  # a folder that was there stays, as empty as it was
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        quantize(path, str(out), scheme)


def test_quantize_names_a_source_whose_name_is_not_utf8(tmp_path):
    """A source folder whose name is not UTF-8 is refused in the words a load uses (it had been
    nanobind's "incompatible function arguments")."""
    from diffuserve.quantize import quantize
    src = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff")
    os.mkdir(src)
    with pytest.raises(ValueError, match="the source checkpoint .* is not valid UTF-8, which the runtime needs"):
        quantize(src, str(tmp_path / "out"))


def test_quantize_writes_into_a_new_or_empty_directory_only(tmp_path):
    """Over its source, or into a directory holding another checkpoint's shards and index
    (which a load would pass over for the model.safetensors written beside them), a quantized
    copy would leave a directory holding two models: both are refused before anything is
    written."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, seed=3, hidden_size=64)
    before = sorted(os.listdir(src))
    with pytest.raises(ValueError, match="the output directory is the source"):
        quantize(src, src)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"other is not empty \(model.safetensors.index.json\)"):
        quantize(src, str(tmp_path / "other"))
    assert sorted(os.listdir(src)) == before and os.listdir(tmp_path / "other") == ["model.safetensors.index.json"]
    # Any file: one a load reads (a stale chat_template.jinja had won over the source's template).
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "chat_template.jinja").write_text("STALE")
    with pytest.raises(ValueError, match=r"stale is not empty \(chat_template.jinja\)"):
        quantize(src, str(tmp_path / "stale"))
    (tmp_path / "empty").mkdir()
    quantize(src, str(tmp_path / "empty"))  # an empty directory is fine
    ds.Model.load(str(tmp_path / "empty"))


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4"])
def test_quantized_weights_do_not_depend_on_the_dtype(tmp_path, scheme):
    """A quantized linear multiplies its exact dequantized values whatever dtype the plain
    weights load in (as the GPU's packed GEMM does), not those values rounded to bf16: on a
    bf16 source (hidden 64, so that sqrt(hidden) is a bf16 value too) "bfloat16" and
    "float32" give the same logits, bit for bit."""
    from diffuserve.quantize import quantize
    from diffuserve.random_checkpoint import write_random_checkpoint
    src = write_random_checkpoint(tmp_path / "src", canvas_length=8, dtype="bfloat16", seed=3, hidden_size=64)
    quantize(src, str(tmp_path / scheme), scheme)
    logits = []
    for dtype in ("bfloat16", "float32"):
        seq = ds.Model.load(str(tmp_path / scheme), dtype=dtype).sequence()
        seq.prefill(np.arange(3, 20))
        logits.append(seq.denoise(np.arange(8)))
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_weights_are_the_same_whatever_the_threads(dtype):
    """load_format="dummy" draws each weight's values by their index, on the thread pool a
    chunk at a time and stored in the weight dtype as drawn: one thread or two, the same
    weights, so the same logits bit for bit."""
    path = os.path.join(FIXTURES, "base")
    logits = []
    for threads in (1, 2):
        seq = ds.Model.load(path, dtype=dtype, load_format="dummy", num_threads=threads).sequence()
        seq.prefill(np.arange(3, 20))
        logits.append(seq.denoise(np.arange(8)))
    assert np.isfinite(logits[0]).all()
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize("quantization", ["fp8", "fp8-dynamic", "nvfp4"])
def test_dummy_weights_can_be_quantized(quantization):
    """load_format="dummy" with a quantization: the linears' random weights are packed
    (here dequantized by the CPU backend as it multiplies them); the same draws each time,
    scaled like the plain dummy weights, so that the passes stay finite and of the same size."""
    path = os.path.join(FIXTURES, "base")
    canvas = np.arange(8)
    logits = {}
    for q in (None, quantization, quantization):
        seq = ds.Model.load(path, dtype="float32", load_format="dummy", quantization=q).sequence()
        seq.prefill(np.arange(3, 20))
        logits.setdefault(q, []).append(seq.denoise(canvas))
    quantized, plain = logits[quantization], logits[None][0]
    np.testing.assert_array_equal(quantized[0], quantized[1])
    assert np.isfinite(quantized[0]).all() and not np.array_equal(quantized[0], plain)
    assert 0.2 < quantized[0].std() / plain.std() < 5


def test_dummy_fp8_dynamic_quantizes_the_inputs():
    """"fp8-dynamic": the same FP8 weights as "fp8", the linears' inputs rounded to FP8 per
    token as well: a different pass of the same size. (The random model carries the
    rounding through its layers, so the two differ by far more than one rounding.)"""
    path = os.path.join(FIXTURES, "base")
    out = {}
    for q in ("fp8", "fp8-dynamic"):
        seq = ds.Model.load(path, dtype="float32", load_format="dummy", quantization=q).sequence()
        seq.prefill(np.arange(3, 20))
        out[q] = seq.denoise(np.arange(8))
    assert np.isfinite(out["fp8-dynamic"]).all()
    assert np.abs(out["fp8"] - out["fp8-dynamic"]).max() > 1e-3 * np.abs(out["fp8"]).max()
    assert 0.5 < out["fp8-dynamic"].std() / out["fp8"].std() < 2


@pytest.mark.parametrize("args, message", [
    (dict(quantization="fp8"), "quantization 'fp8' is for load_format 'dummy'"),
    (dict(load_format="dummy", quantization="int4"),
     "quantization 'int4' is not supported (use fp8, fp8-dynamic or nvfp4)"),
])
def test_dummy_quantization_errors(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ds.Model.load(os.path.join(FIXTURES, "base"), **args)


# activations="bfloat16": the linears' and experts' inputs rounded to bf16 before their
# products (the faster GPU mode; transformers in bf16 rounds them too). Close to the fp32
# products, not the same; the router stays fp32; an unknown value is refused by name.
def test_bf16_activations_round_the_linear_inputs(tmp_path):
    from diffuserve.random_checkpoint import write_random_checkpoint
    path = write_random_checkpoint(tmp_path / "m", canvas_length=16, dtype="bfloat16", seed=4, vocab_size=300,
                                   hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, global_head_dim=64,
                                   num_global_key_value_heads=1, sliding_window=24, num_experts=4, top_k_experts=2,
                                   moe_intermediate_size=32)
    exact, rounded = (ds.Model.load(path, activations=a).sequence() for a in ("float32", "bfloat16"))
    rng = np.random.default_rng(0)
    prompt, canvas = rng.integers(0, 300, 40), rng.integers(0, 300, 16)
    for s in (exact, rounded):
        s.prefill(prompt)
    a, b = exact.denoise(canvas), rounded.denoise(canvas)
    rel = np.abs(a - b).max() / np.abs(a).max()
    print(f"bf16 inputs: max |diff| / range {rel:.2e}, argmax agreement {(a.argmax(-1) == b.argmax(-1)).mean():.3f}")
    assert 0 < rel < 3e-2 and np.isfinite(b).all()
    out = ds.LLM(path, activations="bfloat16").generate([[1, 2, 3]], ds.SamplingParams(max_new_tokens=16, seed=1))
    assert len(out[0].token_ids) > 0
    with pytest.raises(ValueError, match="activations"):
        ds.Model.load(path, activations="float8")
