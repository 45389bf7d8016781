"""deepinfer: an inference engine for DeepSeek's mixture-of-experts models."""

from deepinfer.inputs import TextPrompt, TokensPrompt
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in torch models and the engine; import it lazily so that
    # `from deepinfer import SamplingParams` stays cheap.
    if name == "LLM":
        from deepinfer.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "StructuredOutputsParams", "GuidedDecodingParams", "TextPrompt", "TokensPrompt"]
