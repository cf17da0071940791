"""transformers' DiffusionGemma with random weights, made on a device with one copy of each weight.

Made the usual way (`DiffusionGemmaForBlockDiffusion(config)` under `torch.device("cuda")`), the
model first gives the encoder's layers and the decoder's their own weights and only then ties them
(`_tied_weights_keys`): at the 26B-A4B shapes that is two copies of the 50 GB of layer weights at
once, more than an 80 GB H100 holds (step_latency.py's `--hf` ran out of memory there at 77.4 GiB).
Here the parameters are made on the meta device, where the ties cost nothing, the buffers as usual;
then each distinct parameter gets one tensor on the device, and transformers' own initialisation
fills them. tests/test_hf_random.py checks the result against a model made the usual way.
"""
import contextlib

import torch
from transformers import DiffusionGemmaForBlockDiffusion


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
