"""Write a tiny Llama and its tokenizer directory, from local files only (the tests serve it: it compiles in seconds).

    python deployments/example_models/make_tiny_llm.py OUT

The tokenizer is a byte-level BPE trained in seconds on this repository's own text
(README.md and the docs), with a chat template; the model is a small Llama with random
weights sized to that vocabulary. Both are written with ``save_pretrained``, so
``AutoModelForCausalLM`` and ``AutoTokenizer`` read the directory as they read a model
from a hub, and nothing is downloaded. The same seed gives the same directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tokenizers
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]
# A Llama-3-like template: one role marker a turn, the assistant's marker last when asked to answer.
# Tools (OpenAI's, as transformers passes them) are listed first, each its name and parameters' schema; an assistant's tool calls are
# written as Hermes writes them, <tool_call>{"name": ..., "arguments": ...}</tool_call>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for tool in tools %}{{ tool.function.name }}"
    "{{ (tool.function.parameters or {}) | tojson }}{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [line for f in files if f.is_file() for line in f.read_text().splitlines() if line.strip()]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[1],
                                                pad_token=SPECIAL[1], chat_template=CHAT_TEMPLATE)


def model(tok: transformers.PreTrainedTokenizerFast) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def main(out: Path) -> None:
    tok = tokenizer()
    model(tok).save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out} (vocabulary {len(tok)}, {sum(p.numel() for p in model(tok).parameters())} parameters)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
