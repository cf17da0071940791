"""transformers' DiffusionGemma with random weights, made on a device with one copy of each weight.

Made the usual way (`DiffusionGemmaForBlockDiffusion(config)` under `torch.device("cuda")`), the
model first gives the encoder's layers and the decoder's their own weights and only then ties them
(`_tied_weights_keys`): at the 26B-A4B shapes that is two copies of the 50 GB of layer weights at
once, more than an 80 GB H100 holds (step_latency.py's `--hf` ran out of memory there at 77.4 GiB).
Here the parameters are made on the meta device, where the ties cost nothing, the buffers as usual;
then each distinct parameter gets one tensor on the device, and transformers' own initialisation
fills them. tests/test_hf_random.py checks the result against a model made the usual way.

`context_cache` gives the decoder a context of any length to read without running the encoder over
it: at 16 sequences of 32K tokens transformers' encoder would take minutes of a benchmark's GPU time
to write keys and values whose values a random model's timing does not depend on.
"""
import contextlib

import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache


@contextlib.contextmanager
def parameters_on_meta():
    """Every nn.Parameter registered inside is moved to the meta device (buffers are left alone)."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:  # (a tie registers a meta parameter again: kept)
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def random_model(config, device):
    """DiffusionGemmaForBlockDiffusion(config) on `device` with transformers' random initialisation,
    tied weights made once."""
    with torch.device(device), parameters_on_meta():
        model = DiffusionGemmaForBlockDiffusion(config)
    made = {}  # id of a meta parameter -> its tensor on the device: a tied weight is one parameter
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device=device),
                                                         requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    for module in model.modules():  # post_init initialised the meta tensors: again, on the device
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    return model.eval()


def context_cache(model, batch, context, chunk=4096):
    """A DynamicCache as `model`'s encoder leaves it after `context` tokens of each of `batch`
    sequences (each layer's keys and values in its own shape, a sliding layer's last window - 1
    kept), holding random values. Written `chunk` tokens at a time, as a chunked prefill writes
    it, so that a sliding layer never holds more than window - 1 + chunk tokens."""
    config = model.config.text_config
    cache = DynamicCache(config=config)
    layers = [layer.self_attn for layer in model.model.encoder.language_model.layers[: config.num_hidden_layers]]
    parameter = next(model.parameters())
    for first in range(0, context, chunk):
        n = min(chunk, context - first)
        for attention in layers:
            heads = attention.k_proj.out_features // attention.head_dim
            shape = (batch, heads, n, attention.head_dim)
            keys = torch.randn(shape, dtype=parameter.dtype, device=parameter.device)
            cache.update(keys, torch.randn_like(keys), attention.layer_idx)
    return cache
