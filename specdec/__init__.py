"""specdec: a speculative-decoding inference engine for LLMs."""

from specdec.config import EngineConfig, SamplingParams
from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
