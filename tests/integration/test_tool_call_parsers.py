"""tool_choice "auto": each tool-call parser reads calls from answers written in its format.

A random model never writes a tool call, so each model here is built to: a one-layer GPT-2
whose blocks add nothing (their output projections are zero) and whose token embeddings are
zero, so the last hidden state is its position's embedding alone; the LM head maps the
embedding of each position after the prompt to the next token of a fixed answer, then to
EOS. Greedy decoding of the test's conversation therefore writes that answer, token for
token, through the compiled prefill and decode like any model's output. One model writes
the Hermes format (``<tool_call>`` blocks, after some content), the other Llama 3's JSON.
Both are served side by side, each with its parser in model.yaml.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers
import yaml

import generation_models as gm
from conftest import Server

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]
# A Hermes-like template, short: the tools' names, then the turns.
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ANSWERS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
}
EXPECTED = {
    "hermes": ("Let me look.\n", [("get_weather", {"city": "Paris"})]),
    "llama3_json": (None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
}
GENERATION = {"max_num_seqs": 2, "max_model_len": 256, "prefill_buckets": [256], "decode_batch_buckets": [2],  # greedy only
              "decode_context_buckets": [256], "on_device_sampling": False}
WIDTH = 256  # hidden size: random position embeddings this wide are near-orthogonal, so each picks its token


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = gm.byte_tokenizer()
    tok.add_special_tokens({"eos_token": "<|end|>"})
    tok.chat_template = TEMPLATE
    return tok


def writer(tok, answer: str) -> torch.nn.Module:
    """A GPT-2 whose greedy answer to MESSAGES with TOOLS is ``answer``, then EOS."""
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    start = len(tok(prompt, add_special_tokens=False)["input_ids"])
    targets = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    config = transformers.GPT2Config(n_embd=WIDTH, n_layer=1, n_head=4, n_positions=256, vocab_size=len(tok),
                                     tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                                     bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        for block in model.transformer.h:
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                projection.weight.zero_()
                projection.bias.zero_()
        positions = torch.randn(config.n_positions, WIDTH)
        model.transformer.wpe.weight.copy_(positions)
        normed = model.transformer.ln_f(positions)
        head = torch.zeros(len(tok), WIDTH)
        # The hidden state at position p predicts the token at p + 1: the answer's i-th token is read
        # from position start - 1 + i.
        for i, token in enumerate(targets):
            head[token] += normed[start - 1 + i]
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-parsers")
    tok = tokenizer()
    configs = []
    for parser, answer in ANSWERS.items():
        model = writer(tok, answer)
        model.save_pretrained(tmp / parser)
        tok.save_pretrained(tmp / parser)
        eager = transformers.AutoModelForCausalLM.from_pretrained(tmp / parser).eval()
        ids = tok(tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = eager.generate(ids, max_new_tokens=120, do_sample=False, pad_token_id=tok.eos_token_id)
        assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == answer  # the model writes it
        (tmp / f"{parser}.yaml").write_text(yaml.safe_dump({
            "name": parser.replace("_", "-"), "task": "generate", "model": {"pretrained": parser},
            "generation": {**GENERATION, "tool_call_parser": parser}}))
        configs.append(str(tmp / f"{parser}.yaml"))
    srv = Server(configs, tmp)
    yield srv
    srv.stop()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("parser", list(ANSWERS))
def test_auto_reads_the_parsers_format_whole_and_streamed(writers, parser):
    content, calls = EXPECTED[parser]
    with openai.OpenAI(base_url=f"{writers.url}/v1", api_key="x", max_retries=0) as api:
        name = parser.replace("_", "-")
        answer = api.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                             temperature=0)
        choice = answer.choices[0]
        assert (choice.finish_reason, choice.message.content, calls_of(choice.message)) == \
            ("tool_calls", content, calls)
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
        streamed: dict[int, dict] = {}
        text, finish = "", None
        for chunk in api.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                                 temperature=0, stream=True):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for call in delta.tool_calls or []:
                entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (finish, text or None) == ("tool_calls", content)
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == calls
        # tool_choice "none": the same answer, as text.
        plain = api.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                            max_tokens=120, temperature=0).choices[0]
        assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == \
            ("stop", ANSWERS[parser], None)
