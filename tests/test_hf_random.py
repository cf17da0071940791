"""benchmarks/hf_random.py's transformers model (parameters made on the meta device, then once each on the
device) against one made the usual way, and its context cache against the one the encoder writes, on tiny
configurations (CPU)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache  # noqa: E402

from hf_reference import F, S, model_config, text  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from hf_random import context_cache, random_model  # noqa: E402


def tensor_bytes(model):
    """Bytes of the model's distinct tensors (a tied weight counted once)."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}.values())


def ties(model):
    """The pairs of parameter names that share one tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = sorted(params)
    return {(a, b) for i, a in enumerate(names) for b in names[i + 1:] if params[a].data_ptr() == params[b].data_ptr()}


@pytest.mark.parametrize("layer_types,dtype", [([S, S, F], torch.bfloat16), ([F, S], torch.float32)])
def test_the_model_is_the_usual_one_with_each_tied_weight_made_once(layer_types, dtype):
    config = model_config(text(layer_types), canvas_length=8)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        usual, made = DiffusionGemmaForBlockDiffusion(config).eval(), random_model(config, "cpu")
    finally:
        torch.set_default_dtype(default)
    assert tensor_bytes(made) == tensor_bytes(usual)
    assert ties(made) == ties(usual) and any("encoder" in a or "encoder" in b for a, b in ties(usual))
    usual_params, made_params = dict(usual.named_parameters()), dict(made.named_parameters())
    assert made_params.keys() == usual_params.keys()
    for name, p in made_params.items():
        assert (p.device.type, p.dtype, p.shape) == ("cpu", usual_params[name].dtype, usual_params[name].shape), name
        assert torch.isfinite(p).all(), name
    # the buffers (RoPE frequencies, embedding scales, layer scalars) are the usual model's exactly
    usual_buffers = dict(usual.named_buffers())
    for name, b in made.named_buffers():
        assert torch.equal(b, usual_buffers[name]), name
    # random where the usual model is random: the experts' weights spread alike
    experts = [n for n in usual_params if n.endswith("gate_up_proj")]
    for name in experts:
        assert made_params[name].float().std().item() == pytest.approx(usual_params[name].float().std().item(), rel=0.3)
    ids = torch.arange(8)[None] + 3
    with torch.no_grad():
        assert torch.isfinite(made(input_ids=ids, decoder_input_ids=ids).logits).all()


@pytest.mark.parametrize("batch,context,chunk", [(1, 5, 4), (2, 19, 4), (3, 8, 16), (2, 7, 7)])
def test_the_context_cache_is_shaped_as_the_encoders(batch, context, chunk):
    """Each layer's keys and values, the lengths and the decoder's mask sizes are those the encoder
    leaves after `context` tokens (sliding window 8: contexts below, at and past it), and the
    decoder reads it."""
    config = model_config(text([S, F, S]), canvas_length=8)
    model = random_model(config, "cpu")
    made = context_cache(model, batch, context, chunk=chunk)
    written = DynamicCache(config=config.text_config)
    ids = torch.arange(batch * context).remainder(90).add(3).view(batch, context)
    canvas = torch.arange(8)[None].repeat(batch, 1) + 5
    with torch.no_grad():
        for part in ids.split(chunk, dim=1):
            model.model.encoder(input_ids=part, cache=written)
        assert made.get_seq_length() == written.get_seq_length() == context
        for i, (a, b) in enumerate(zip(made.layers, written.layers, strict=True)):
            assert type(a) is type(b), i
            assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape, i
            assert (a.keys.dtype, a.keys.device) == (b.keys.dtype, b.keys.device), i
            assert a.get_mask_sizes(8) == b.get_mask_sizes(8), i
        logits = model(decoder_input_ids=canvas, cache=made).logits
    assert logits.shape == (batch, 8, config.text_config.vocab_size) and torch.isfinite(logits).all()
