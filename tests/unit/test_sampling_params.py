"""SamplingParams: defaults, normalisation, and one ValueError per bad field value."""

import pytest

from deepinfer.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None and p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_valid_edge_values():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=0.5, logit_bias={0: -100.0, 7: 100}, seed=-5, max_tokens=None,
                   min_tokens=3, logprobs=0, prompt_logprobs=0, stop_token_ids=[0])
    SamplingParams(max_tokens=4, min_tokens=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n=0 must be >= 1"),
    (dict(n=1.5), "n=1.5 must be an int >= 1"),
    (dict(temperature=-1), "temperature=-1 must be >= 0"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    (dict(top_p=1.01), "top_p=1.01 must be in (0, 1]"),
    (dict(top_k=-2), "top_k=-2 must be an int >= 1, or 0 / -1 to disable it"),
    (dict(top_k=2.0), "top_k=2.0 must be an int >= 1"),
    (dict(min_p=-0.1), "min_p=-0.1 must be in [0, 1]"),
    (dict(min_p=1.5), "min_p=1.5 must be in [0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(presence_penalty=-2.5), "presence_penalty=-2.5 must be in [-2, 2]"),
    (dict(frequency_penalty=3), "frequency_penalty=3 must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty=-1.0 must be > 0"),
    (dict(logit_bias=[1, 2]), "logit_bias=[1, 2] must be a dict"),
    (dict(logit_bias={-1: 1.0}), "logit_bias key -1 must be a token id (an int >= 0)"),
    (dict(logit_bias={"5": 1.0}), "logit_bias key '5' must be a token id (an int >= 0)"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5]=101.0 must be in [-100, 100]"),
    (dict(seed=1.0), "seed=1.0 must be an int or None"),
    (dict(stop=[""]), "every stop string must be a non-empty str"),
    (dict(stop=["a", 3]), "every stop string must be a non-empty str"),
    (dict(stop_token_ids=[-1]), "stop_token_ids entry -1 must be a token id (an int >= 0)"),
    (dict(ignore_eos=1), "ignore_eos=1 must be True or False"),
    (dict(max_tokens=0), "max_tokens=0 must be >= 1"),
    (dict(min_tokens=-1), "min_tokens=-1 must be >= 0"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens=5 must be <= max_tokens=4"),
    (dict(logprobs=-2), "logprobs=-2 must be an int >= 0, or -1 for the whole vocabulary"),
    (dict(prompt_logprobs=1.0), "prompt_logprobs=1.0 must be an int >= 0, or -1 for the whole vocabulary"),
    (dict(skip_special_tokens=None), "skip_special_tokens=None must be True or False"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output='yes' must be True or False"),
    (dict(output_kind=2), "output_kind=2 must be a RequestOutputKind"),
])
def test_invalid_field_raises(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={100: 1.0}), "logit_bias key 100 must be < vocab_size=100"),
    (dict(stop_token_ids=[5, 100]), "stop_token_ids entry 100 must be < vocab_size=100"),
    (dict(logprobs=21), "logprobs=21 must be <= max_logprobs=20"),
    (dict(prompt_logprobs=21), "prompt_logprobs=21 must be <= max_logprobs=20"),
])
def test_verify_for_model_rejects(kwargs, message):
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as err:
        p.verify_for_model(vocab_size=100)
    assert message in str(err.value)


def test_verify_for_model_accepts():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99], logprobs=20, prompt_logprobs=20,
                   top_k=1000).verify_for_model(vocab_size=100)
    SamplingParams(logprobs=50).verify_for_model(vocab_size=100, max_logprobs=50)


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, seed=3)
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.logit_bias[2] = 1.0
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0}


def test_output_kind():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE          # vLLM's default
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(NotImplementedError, match="output_kind=DELTA is not supported yet"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
