"""diffuserve: an inference engine for block-diffusion language models (DiffusionGemma).

    import diffuserve as ds
    m = ds.Model.load(path)                 # a DiffusionGemma checkpoint directory
    seq = m.sequence()
    seq.prefill(prompt_ids)                 # causal encoder pass, appends KV
    logits = seq.denoise(canvas_ids)        # np.float32 [canvas, vocab], softcapped
    seq.commit(canvas_ids)                  # causal pass over a finished block
"""
from pathlib import Path

from . import _core
from ._core import CheckpointError
from .llm import LLM, RequestOutput
from .model import Model, Sequence
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"
__all__ = ["Model", "Sequence", "LLM", "SamplingParams", "RequestOutput", "Tokenizer", "CheckpointError",
           "cmake_dir", "include_dir", "default_model"]

_HERE = Path(__file__).resolve().parent
# Where the build installed the extension, and beside it the C++ library, headers and CMake
# package: this package's directory, but for an editable install, whose Python files stay in the
# source tree.
_INSTALLED = Path(_core.__file__).resolve().parent


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
    found = sorted(_INSTALLED.glob("lib*/cmake/diffuserve"))
    if not found:
        raise FileNotFoundError(f"no CMake package under {_INSTALLED}: is diffuserve installed from a wheel?")
    return str(found[0])


def include_dir() -> str:
    """Directory holding the C++ headers (diffuserve/diffuserve.h)."""
    path = _INSTALLED / "include"
    if not (path / "diffuserve" / "diffuserve.h").is_file():
        raise FileNotFoundError(f"no C++ headers under {_INSTALLED}: is diffuserve installed from a wheel?")
    return str(path)
