"""tokenmill: a high-throughput LLM inference and serving engine on JAX."""

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in JAX; import it on first use so `import tokenmill` stays light.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
