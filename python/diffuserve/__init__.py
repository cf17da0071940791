"""diffuserve: an inference engine for block-diffusion language models (DiffusionGemma).

    import diffuserve as ds
    m = ds.Model.load(path)                 # a DiffusionGemma checkpoint directory
    seq = m.sequence()
    seq.prefill(prompt_ids)                 # causal encoder pass, appends KV
    logits = seq.denoise(canvas_ids)        # np.float32 [canvas, vocab], softcapped
    seq.commit(canvas_ids)                  # causal pass over a finished block
"""
from pathlib import Path

from ._core import CheckpointError
from .llm import LLM, RequestOutput
from .model import Model, Sequence
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"
__all__ = ["Model", "Sequence", "LLM", "SamplingParams", "RequestOutput", "Tokenizer", "CheckpointError",
           "cmake_dir", "include_dir", "default_model"]

_HERE = Path(__file__).resolve().parent


def default_model() -> str:
    """The bundled model's directory: a small DiffusionGemma trained to solve Sudoku
    (training/sudoku/train.py), used wherever no model is given."""
    path = _HERE / "sudoku_model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"diffuserve's bundled model is missing from this install ({path}): reinstall "
                                "diffuserve, or pass a checkpoint directory")
    return str(path)


def cmake_dir() -> str:
    """Directory holding diffuserveConfig.cmake, for `-Ddiffuserve_DIR=...`."""
    found = sorted(_HERE.glob("lib*/cmake/diffuserve"))
    if not found:
        raise FileNotFoundError(f"no CMake package under {_HERE}: is diffuserve installed from a wheel?")
    return str(found[0])


def include_dir() -> str:
    """Directory holding the C++ headers (diffuserve/diffuserve.h)."""
    return str(_HERE / "include")
