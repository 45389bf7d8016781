"""vLLM's offline API on the embedded model: LLM's keyword arguments (honoured, logged as a
no-op, or refused), prompt forms, chat options, get_tokenizer, the SamplingParams fields
beyond the basic ones, and vLLM's RequestOutput / CompletionOutput fields."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams, TextPrompt, TokensPrompt
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL, build_engine_config, generation_defaults
from deepinfer.entrypoints.llm_args import parse_llm_kwargs, resolve_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine_args(**kwargs) -> dict:
    return parse_llm_kwargs(None, kwargs, build_engine_config, DEFAULT_MODEL).engine


# -- LLM(...) keyword arguments -------------------------------------------------------------------

def test_vllm_options_map_onto_the_engine_config():
    config = build_engine_config(**engine_args(
        device="cpu", enforce_eager=True, max_num_seqs=7, max_num_batched_tokens=96, enable_prefix_caching=False,
        block_size=8, max_model_len=512, gpu_memory_utilization=0.5, seed=3, num_gpu_blocks_override=40,
        max_logprobs=5, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}, tensor_parallel_size=1,
        pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=True, dtype="float32",
        kv_cache_dtype="auto", load_format="safetensors", hf_overrides={"sliding_window": 16},
        tokenizer=DEFAULT_MODEL))
    assert config.enforce_eager and config.seed == 3
    s, c, m = config.scheduler, config.cache, config.model
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.cuda_graph_sizes) == (7, 96, (1, 2, 4))
    assert (c.enable_prefix_caching, c.block_size, c.gpu_memory_utilization, c.num_blocks_override) == \
        (False, 8, 0.5, 40)
    assert (m.max_model_len, m.max_logprobs, m.tokenizer_path) == (512, 5, DEFAULT_MODEL)
    assert m.hf_config["sliding_window"] == 16 and m.hf_config["num_hidden_layers"] == 7
    assert config.parallel.ep == 1


def test_none_means_the_default_as_in_vllm():
    config = build_engine_config(**engine_args(device="cpu", seed=None, max_num_seqs=None, block_size=None,
                                               enable_prefix_caching=None, enable_chunked_prefill=None,
                                               max_num_batched_tokens=None))
    assert config.seed == 0 and config.scheduler.max_num_seqs == 64 and config.cache.block_size == 16
    assert config.cache.enable_prefix_caching and config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 2048
    # Without chunked prefill the token budget must hold a whole prompt (vLLM's rule).
    unchunked = build_engine_config(**engine_args(device="cpu", enable_chunked_prefill=False, max_model_len=4096))
    assert unchunked.scheduler.max_num_batched_tokens == 4096


def test_compilation_config_none_mode_is_enforce_eager(caplog):
    with caplog.at_level(logging.INFO, "deepinfer.llm"):
        args = engine_args(compilation_config={"level": 3, "cudagraph_mode": "NONE"})
    assert args["enforce_eager"] is True
    assert "does not use torch.compile" in caplog.text
    with pytest.raises(ValueError, match="compilation_config: use_inductor not supported"):
        engine_args(compilation_config={"use_inductor": True})


@pytest.mark.parametrize("kwargs", [dict(trust_remote_code=True), dict(swap_space=8), dict(download_dir="/nowhere"),
                                    dict(disable_custom_all_reduce=True), dict(hf_token="x")])
def test_no_op_options_are_accepted_and_logged(kwargs, caplog):
    with caplog.at_level(logging.INFO, "deepinfer.llm"):
        engine_args(**kwargs)
    name = next(iter(kwargs))
    assert f"LLM({name}=" in caplog.text and "has no effect" in caplog.text


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), NotImplementedError,
     r"speculative_config method='mtp' runs DeepSeek-V3 MTP modules.*use method='dspark'"),
    (dict(cpu_offload_gb=4), ValueError, "offloading weights to CPU memory is not supported"),
    (dict(enable_lora=True), ValueError, "LoRA adapters are not supported"),
    (dict(tokenizer_mode="slow"), ValueError, r"tokenizer_mode='slow'\) is not supported"),
    (dict(task="embed"), ValueError, "generates text only"),
    (dict(quantization="awq"), ValueError, "quantization='awq' is not supported.*choose one of auto, none, fp8"),
    (dict(tensor_parallel_size=4), ValueError, "tensor_parallel_size=4 must divide config.json o_groups=2"),
    (dict(pipeline_parallel_size=4), NotImplementedError, r"pp=4 \(pipeline_parallel_size\).*not yet supported"),
    (dict(data_parallel_size=2), NotImplementedError, r"dp=2 \(data_parallel_size\)"),
    (dict(tensor_parallel_sise=1), ValueError, "unknown keyword argument 'tensor_parallel_sise'; did you mean "
                                               "'tensor_parallel_size'"),
    (dict(max_num_seq=4), ValueError, "did you mean 'max_num_seqs'"),
    (dict(hf_overrides=lambda c: c), ValueError, "a callable.*is not supported"),
    (dict(load_format="pt"), ValueError, "load_format='pt' is not supported"),
])
def test_unsupported_options_are_refused_before_building(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(device="cpu", **kwargs)


def test_quantization_naming_the_checkpoints_own_method_is_accepted(tmp_path):
    config = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    built = build_engine_config(device="cpu", hf_config=config, quantization="fp8", load_format="dummy")
    assert built.model.hf_config["quantization_config"]["quant_method"] == "fp8"
    assert built.model.quantization == "fp8"
    assert build_engine_config(device="cpu", hf_config=config, load_format="dummy").model.quantization == "auto"
    with pytest.raises(ValueError, match="its own is 'fp8'"):
        build_engine_config(device="cpu", hf_config=config, quantization="gptq", load_format="dummy")


def fake_hf_cache(root: Path, repo: str, revision: str = "main") -> Path:
    """The layout huggingface_hub keeps: models--org--name/{refs/<rev>, snapshots/<hash>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / revision).write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(DEFAULT_MODEL, snapshot)
    return snapshot


def test_a_repo_id_is_found_in_the_local_cache_and_never_downloaded(tmp_path):
    snapshot = fake_hf_cache(tmp_path, "deepinfer/tiny-model")
    assert Path(resolve_checkpoint("model", "deepinfer/tiny-model", None, str(tmp_path))) == snapshot
    with pytest.raises(FileNotFoundError, match="holds no copy of it at revision 'v2': deepinfer downloads nothing"):
        resolve_checkpoint("model", "deepinfer/tiny-model", "v2", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="deepinfer downloads nothing"):
        resolve_checkpoint("model", "deepseek-ai/not-here", None, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_checkpoint("model", str(tmp_path / "missing" / "dir" / "x"), None, None)


def test_llm_from_a_cached_repo_id(tmp_path):
    fake_hf_cache(tmp_path, "org/tiny")
    llm = LLM("org/tiny", download_dir=str(tmp_path), device="cpu", max_num_batched_tokens=256)
    ref = LLM(device="cpu", max_num_batched_tokens=256)
    prompt = "The list type"
    assert (llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


# -- prompts, tokenizer, outputs -------------------------------------------------------------------

def test_prompt_forms_agree(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    assert isinstance(tok, Tokenizer)
    text = "The list type is"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok(text)["input_ids"] == ids
    outs = tiny_llm.generate(prompts=[text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), ids,
                                      {"prompt_token_ids": ids, "prompt": "label"}],
                             sampling_params=GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, text, None, None, "label"]
    assert all(o.prompt_token_ids == ids for o in outs)
    # One dict or one list of ids is one prompt.
    assert len(tiny_llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == 1
    assert len(tiny_llm.generate(ids, GREEDY, use_tqdm=False)) == 1


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "x", "multi_modal_data": {"image": 1}}, r"\['multi_modal_data'\]: multimodal inputs are not supported"),
    ({"text": "x"}, "unknown key"),
    ({"prompt_token_ids": ["a"]}, "must be a list of int token ids"),
    ({}, "needs 'prompt'"),
    (3.5, "must be a str, a list of token ids"),
])
def test_bad_prompts_are_refused(tiny_llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(["fine", prompt], GREEDY, use_tqdm=False)


def test_request_output_has_vllms_fields(tiny_llm):
    out = tiny_llm.generate("The list type", SamplingParams(max_tokens=4, logprobs=2, seed=1), use_tqdm=False)[0]
    for name in ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
                 "num_cached_tokens", "metrics", "lora_request", "encoder_prompt", "encoder_prompt_token_ids"):
        assert hasattr(out, name), name
    c = out.outputs[0]
    assert (c.index, len(c.token_ids), c.finish_reason, c.stop_reason) == (0, 4, "length", None)
    assert isinstance(c.cumulative_logprob, float) and len(c.logprobs) == 4 and c.finished()


def test_default_sampling_params_come_from_generation_config(tmp_path):
    assert generation_defaults(DEFAULT_MODEL) == {}    # the embedded model's sets none
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "do_sample": True}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 5}
    llm = LLM(device="cpu", generation_config=str(tmp_path), max_num_batched_tokens=256)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 5)
    assert len(llm.generate("Hi", use_tqdm=False)[0].outputs[0].token_ids) <= 5
    assert engine_args(generation_config="vllm") is not None
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        engine_args(generation_config="nowhere")


# -- chat -----------------------------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "You are a helpful assistant"},
                {"role": "user", "content": "What does json.dumps do?"}]


def test_chat_batch_template_and_content_formats(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    single = tiny_llm.chat(CONVERSATION, params, use_tqdm=False)[0]
    batch = tiny_llm.chat([CONVERSATION, CONVERSATION], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [single.outputs[0].token_ids] * 2
    assert single.prompt == tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert single.prompt.endswith("<|im_start|>assistant\n")
    assert single.prompt_token_ids == tok.encode(single.prompt, add_special_tokens=False)
    # Content as OpenAI parts renders as the string; "openai" turns strings into parts.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    for messages, fmt in ((parts, "auto"), (parts, "string"), (CONVERSATION, "openai")):
        out = tiny_llm.chat(messages, params, use_tqdm=False, chat_template_content_format=fmt)[0]
        assert out.prompt == single.prompt
    # A template of the caller's own, and template variables.
    template = "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}] {{ m['content'] }}\n{% endfor %}"
    own = tiny_llm.chat(CONVERSATION, params, use_tqdm=False, chat_template=template,
                        chat_template_kwargs={"greeting": "hey"})[0]
    assert own.prompt == "[system|hey] You are a helpful assistant\n[user|hey] What does json.dumps do?\n"
    with pytest.raises(ValueError, match="only text parts are supported"):
        tiny_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                      params, use_tqdm=False)


def test_chat_continue_final_message(tiny_llm):
    conv = CONVERSATION + [{"role": "assistant", "content": "It returns a JSON"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    out = tiny_llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nIt returns a JSON")
    # The same as generating from that text directly.
    tok = tiny_llm.get_tokenizer()
    direct = tiny_llm.generate([tok.encode(out.prompt, add_special_tokens=False)], params, use_tqdm=False)[0]
    assert direct.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="pass add_generation_prompt=False"):
        tiny_llm.chat(conv, params, use_tqdm=False, continue_final_message=True)


# -- SamplingParams fields --------------------------------------------------------------------------

def test_allowed_token_ids_restrict_every_draw(tiny_llm):
    allowed = [17, 42, 99, 500]
    for temperature in (0.0, 1.0):
        out = tiny_llm.generate("The list type", SamplingParams(temperature=temperature, seed=5, max_tokens=10,
                                                                allowed_token_ids=allowed, ignore_eos=True),
                                use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 10 and set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_completed(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompt = "The list type is"
    free = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    # Ban the greedy continuation's first token as a word, and its next two tokens as a
    # phrase after a prompt ending in the first of them (so only the second is banned).
    first = tok.decode(free.token_ids[:1]).strip()
    banned = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                      bad_words=[first]), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != free.token_ids[0]
    for word in (tok.encode(first, add_special_tokens=False), tok.encode(" " + first, add_special_tokens=False)):
        n = len(word)
        assert all(banned.token_ids[i:i + n] != word for i in range(len(banned.token_ids) - n + 1)), word
    # A two-token phrase: its second token is banned right after its first is generated.
    phrase = tok.decode(free.token_ids[1:3])
    assert free.token_ids[1:3] in tiny_llm.engine.bad_words_token_ids([phrase])
    ids = tok.encode(prompt) + free.token_ids[:1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, bad_words=[phrase])
    out = tiny_llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == free.token_ids[1] and out.token_ids[1] != free.token_ids[2]


def test_detokenize_false_gives_ids_without_text(tiny_llm):
    out = tiny_llm.generate("The list type", SamplingParams(temperature=0.0, max_tokens=6, detokenize=False,
                                                            logprobs=1), use_tqdm=False)[0].outputs[0]
    ref = tiny_llm.generate("The list type", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert out.text == "" and out.token_ids == ref.outputs[0].token_ids
    assert all(lp.decoded_token is None for pos in out.logprobs for lp in pos.values())


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    ids = tok.encode("This module provides access to some objects used or maintained by the interpreter")
    out = tiny_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=5),
                            use_tqdm=False)[0]
    ref = tiny_llm.generate(ids[-5:], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:] and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_llm):
    with pytest.raises(ValueError, match="logprobs=-1 must be <= max_logprobs=20"):
        tiny_llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    llm = LLM(device="cpu", max_logprobs=-1, max_num_batched_tokens=256)
    vocab = llm.engine.config.model.vocab_size
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert all(len(pos) == vocab for pos in out.outputs[0].logprobs)
    assert out.prompt_logprobs[0] is None and all(len(pos) == vocab for pos in out.prompt_logprobs[1:])


def test_spaces_between_special_tokens(tmp_path):
    """A WordPiece decoder puts a space between tokens; False drops it between two added
    tokens only, as vLLM does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["<a>", "<b>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path))
    a, b = tok.encode("<a>")[0], tok.encode("<b>")[0]
    ids = [1, a, b, 2, b]
    assert tok.decode(ids, skip_special_tokens=False) == "hello <a> <b> world <b>"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "hello <a><b> world <b>"
    assert tok.decode(ids, spaces_between_special_tokens=False) == "hello world"


def test_sampling_params_vllm_fields():
    assert SamplingParams(best_of=2, n=2).n == 2 and SamplingParams(seed=-1).seed is None
    assert SamplingParams(guided_decoding={"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]
    assert SamplingParams(logits_processors=None, use_beam_search=False).n == 1   # vLLM defaults: nothing asked
    assert SamplingParams.from_optional(temperature=None, top_p=0.5, seed=None).temperature == 1.0
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}
    for kwargs, message in ((dict(best_of=3), "best_of=3 with n=1"),
                            (dict(logits_processors=[print]), "custom logits processors"),
                            (dict(use_beam_search=True), "beam search is not supported"),
                            (dict(stop=["x"], detokenize=False), "needs detokenize=True"),
                            (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens=0 must be"),
                            (dict(allowed_token_ids=[]), "allowed_token_ids=.* must be a non-empty list"),
                            (dict(bad_words=["  "]), "every bad word must be a non-blank str"),
                            (dict(max_token=3), "unknown keyword argument 'max_token'; did you mean 'max_tokens'"),
                            (dict(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"}),
                             "not both")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="allowed_token_ids entry 1000 must be < vocab_size=1000"):
        SamplingParams(allowed_token_ids=[1000]).verify_for_model(1000)
