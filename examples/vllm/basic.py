"""vLLM's basic offline example with the import changed to deepinfer and the model to the
embedded default (``LLM()``): a batch of prompts, one SamplingParams, the outputs."""

from deepinfer import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main() -> None:
    llm = LLM()
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated outputs:\n" + "-" * 60)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Output: {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
