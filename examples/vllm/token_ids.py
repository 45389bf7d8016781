"""vLLM's prompt forms with the import changed to deepinfer and the model to the embedded
default: token ids (TokensPrompt), text (TextPrompt) and plain strings in one batch."""

from deepinfer import LLM, SamplingParams
from deepinfer.inputs import TextPrompt, TokensPrompt


def main() -> None:
    llm = LLM()
    tokenizer = llm.get_tokenizer()
    sampling_params = SamplingParams(temperature=0, max_tokens=24)

    token_ids = tokenizer.encode("The capital of France is")
    prompts = [
        TokensPrompt(prompt_token_ids=token_ids),
        TextPrompt(prompt="The capital of France is"),
        {"prompt_token_ids": tokenizer.encode("The future of AI is")},
        "Hello, my name is",
    ]
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r} ({len(output.prompt_token_ids)} tokens)")
        print(f"Token ids: {output.outputs[0].token_ids}")
        print(f"Text: {tokenizer.decode(output.outputs[0].token_ids)!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
