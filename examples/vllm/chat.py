"""vLLM's chat example with the import changed to deepinfer and the model to the embedded
default: one conversation, a batch of them, and an optional chat template from a file."""

import argparse

from deepinfer import LLM, SamplingParams


def print_outputs(outputs) -> None:
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {output.outputs[0].text!r}")
    print("-" * 80)


def main(args: argparse.Namespace) -> None:
    # Options left unset keep SamplingParams' defaults.
    sampling_params = SamplingParams.from_optional(max_tokens=args.max_tokens, temperature=args.temperature,
                                                   top_p=args.top_p, top_k=args.top_k)
    llm = LLM()

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False))

    # A batch of conversations in one call.
    conversations = [conversation for _ in range(10)]
    print_outputs(llm.chat(conversations, sampling_params, use_tqdm=True))

    # A chat template of one's own instead of the model's.
    if args.chat_template_path:
        with open(args.chat_template_path) as f:
            chat_template = f.read()
        print_outputs(llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--chat-template-path", type=str, default=None)
    main(parser.parse_args())
