"""vLLM's SamplingParams options with the import changed to deepinfer and the model to the
embedded default: several samples per prompt, seeds, stops, penalties, logprobs."""

from deepinfer import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    prompt = "The future of AI is"
    settings = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=32),
        "two seeded samples": SamplingParams(n=2, temperature=0.8, top_p=0.95, top_k=50, seed=42, max_tokens=32),
        "stop at a period": SamplingParams(temperature=0.0, stop=["."], include_stop_str_in_output=True,
                                           max_tokens=64),
        "penalties and min_p": SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5,
                                              frequency_penalty=0.5, repetition_penalty=1.2, seed=0,
                                              max_tokens=32),
        "top-3 logprobs": SamplingParams(temperature=0.0, logprobs=3, max_tokens=8),
        "at least 20 tokens, no 'the'": SamplingParams(temperature=0.0, min_tokens=20, bad_words=["the"],
                                                       max_tokens=32),
    }
    for name, params in settings.items():
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        print(f"== {name}")
        for completion in output.outputs:
            print(f"[{completion.index}] {completion.text!r} (finish_reason={completion.finish_reason}, "
                  f"stop_reason={completion.stop_reason!r})")
            if completion.logprobs:
                first = completion.logprobs[0]
                print(f"    first token's top logprobs: "
                      f"{[(lp.decoded_token, round(lp.logprob, 3)) for lp in first.values()]}")
                print(f"    cumulative logprob: {completion.cumulative_logprob:.3f}")


if __name__ == "__main__":
    main()
