"""The Sudoku trainer's lean forward (training/sudoku/lean_model.py) against transformers'
DiffusionGemmaForBlockDiffusion, in fp32 on the CPU: the same logits and the same gradients
of the training loss, with and without self-conditioning, on the trainer's own batches
(tiny model, the bundled checkpoint) and on a config that differs wherever the architecture
allows (per-layer head dims and KV heads, top-3 routing, a prompt shorter than the window,
trained-looking norms, scales and layer scalars)."""
import importlib.util
import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.diffusion_gemma")
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

SUDOKU = os.path.join(os.path.dirname(__file__), "..", "training", "sudoku")
sys.path.insert(0, SUDOKU)
from lean_model import LeanDiffusionGemma  # noqa: E402

# fp32 on both sides: what remains is summation order (observed <= 1.3e-5 on logits and
# <= 9e-5 on gradients, each relative to the tensor's largest magnitude).
LOGITS_RTOL, GRADS_RTOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("sudoku_train", os.path.join(SUDOKU, "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_batch(trainer, size):
    """(prompts, noised canvas, answers) as train.py makes them."""
    rng = random.Random(0)
    pairs = [trainer.sd.generate(rng.randint(26, 45), rng) for _ in range(4)]
    pool = tuple(torch.tensor([[int(c) for c in grid] for grid in grids]) for grids in zip(*pairs))
    gen = torch.Generator().manual_seed(0)
    prompts, answers, free = trainer.batch(pool, size, gen)
    return prompts, trainer.noised(answers, free, gen), answers


def close(a, b, rtol):
    """Within rtol of b's largest magnitude (a zero gradient must be zero)."""
    return (a - b).abs().max() <= rtol * b.abs().max()


def check(model, prompts, canvas, answers):
    lean = LeanDiffusionGemma(model, prompts.shape[1])
    assert {id(p) for p in lean.parameters()} == {id(p) for p in model.parameters()}
    with torch.no_grad():
        sc = model(input_ids=prompts, decoder_input_ids=canvas.roll(1, dims=1)).logits / 0.7

    def logits_and_grads(forward, self_conditioning_logits):
        model.zero_grad(set_to_none=True)
        logits = forward(input_ids=prompts, decoder_input_ids=canvas, self_conditioning_logits=self_conditioning_logits)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), answers.flatten()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for self_conditioning_logits in (None, sc):
        hf_logits, hf_grads = logits_and_grads(lambda **inputs: model(**inputs).logits, self_conditioning_logits)
        lean_logits, lean_grads = logits_and_grads(lean, self_conditioning_logits)
        assert close(lean_logits, hf_logits, LOGITS_RTOL)
        assert lean_grads.keys() == hf_grads.keys()
        for name, grad in hf_grads.items():
            assert close(lean_grads[name], grad, GRADS_RTOL), name


def test_tiny_trainer_model(trainer):
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(trainer.model_config(32, 3, 4, 16))
    check(model, *trainer_batch(trainer, 4))


def test_bundled_checkpoint(trainer):
    path = os.path.join(os.path.dirname(__file__), "..", "python", "diffuserve", "sudoku_model")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
    check(model, *trainer_batch(trainer, 1))


def test_other_shapes():
    text = dict(vocab_size=20, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
                num_experts=5, top_k_experts=3, moe_intermediate_size=16,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                max_position_embeddings=64)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(1)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                                 canvas_length=7))
    with torch.no_grad():  # norms and scales away from their initial ones, encoder and decoder scalars apart
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        encoder, decoder = model.model.encoder.language_model, model.model.decoder
        for i, (a, b) in enumerate(zip(encoder.layers, decoder.layers)):
            a.layer_scalar.fill_(0.8 + 0.1 * i)
            b.layer_scalar.fill_(1.2 - 0.1 * i)
    prompts, canvas = torch.randint(0, 20, (3, 9)), torch.randint(0, 20, (3, 7))
    check(model, prompts, canvas, torch.randint(0, 20, (3, 7)))
