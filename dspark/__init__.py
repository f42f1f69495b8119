"""dspark: lossless speculative decoding for Hugging Face causal LMs with DSpark drafters."""

from dspark.api import GenerationResult, generate, stream
from dspark.drafters import Draft, Drafter, load_drafter
from dspark.errors import DsparkError
from dspark.generation import GenerationStats, speculative_decode
from dspark.loading import load_target
from dspark.sampling import SamplingParams
from dspark.target import Target

__all__ = [
    "Draft", "Drafter", "DsparkError", "GenerationResult", "GenerationStats", "SamplingParams", "Target",
    "generate", "load_drafter", "load_target", "speculative_decode", "stream",
]
__version__ = "0.1.0"
