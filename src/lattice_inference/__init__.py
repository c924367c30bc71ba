"""lattice-inference: lossless speculative decoding for Hugging Face causal LMs.

Drafters propose tokens (n-gram prompt lookup, MTP heads), a target model verifies them all in one forward and
rolls its caches back to the accepted length, and the output is token for token what plain decoding emits,
greedy or sampled with the same seed.
"""

from lattice_inference.api import Generator
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.errors import ConfigError, LatticeError, ModelLoadError, TokenError, UnsupportedModelError
from lattice_inference.generation import Generation, GenerationResult
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.options import DecodeOptions
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import TransformersTarget, make_target

__version__ = "0.3.0"

__all__ = [
    "ConfigError",
    "DecodeOptions",
    "Generation",
    "GenerationMetrics",
    "GenerationResult",
    "Generator",
    "LatticeError",
    "ModelLoadError",
    "NgramDrafter",
    "SamplingOptions",
    "SpeculativeDecoder",
    "TokenError",
    "TransformersTarget",
    "UnsupportedModelError",
    "__version__",
    "make_target",
]
