"""Tiny transformers causal LMs with random weights, one per architecture the engine must serve."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import transformers

VOCAB = 256

# Small configs: two layers, grouped-query attention where the architecture has it.
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 128}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=None, **COMMON),
    "qwen3": lambda: transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB),
    "phi": lambda: transformers.PhiConfig(partial_rotary_factor=0.5, **COMMON),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(rotary_pct=0.25, **COMMON),
}


def build(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A causal LM of ``arch`` with random weights (eager attention, EOS off so lengths are what is asked);
    ``overrides`` change config fields (``num_key_value_heads=1``)."""
    config = CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class NoKernelAtSixteen(transformers.LlamaForCausalLM):
    """A Llama whose forward cannot be traced at 16 tokens a row: its prefill of 16 fails to compile, as a
    model's operator may at one shape (eager, on real tensors, it runs)."""

    def forward(self, input_ids=None, **kwargs):
        traced = input_ids is not None and type(input_ids) is not torch.Tensor
        if traced and input_ids.shape[1] == 16:
            raise NotImplementedError("no kernel for 16 tokens a row")
        return super().forward(input_ids=input_ids, **kwargs)


def failing_llama() -> torch.nn.Module:
    """:func:`build`'s Llama, as :class:`NoKernelAtSixteen`."""
    reference = build("llama")
    lm = NoKernelAtSixteen(reference.config).eval()
    lm.load_state_dict(reference.state_dict())
    lm.generation_config.eos_token_id = None
    return lm


def eager_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy generation of ``new_tokens`` tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def eager_sampled(model: torch.nn.Module, prompt: list[int], new_tokens: int, params) -> list[int]:
    """The tokens a sampled request (``params``: SamplingParams with a seed, on the core's path: no penalties,
    bias or logprobs) must get: each from transformers' own logits of the sequence so far, chosen by the
    sampler the compiled calls end in, run eagerly (the host's choice where it leaves the row to it)."""
    from neuron_serve.generation.sample.sampler import choose_on_host  # noqa: PLC0415

    ids = list(prompt)
    with torch.no_grad():
        for index in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(choose_on_host(logits, params.choice(index)))
    return ids[len(prompt):]


def byte_tokenizer():
    """A byte-level BPE tokenizer of exactly VOCAB ids (the 256 bytes), trained here from local text.

    Any token id decodes, so the text of a random model's output can be matched against.
    """
    import tokenizers  # noqa: PLC0415

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(["neuron-serve generates text one token at a time."], trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


# The projections LoRA adapters of the tiny Llama target.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(directory: Path, arch: str = "llama", seed: int = 1, safe: bool = True, **config):
    """A PEFT adapter of ``build(arch)`` with random non-zero A and B, saved to ``directory``; PEFT's model."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - the LoRA tests' reference only

    with warnings.catch_warnings():  # transformers' deprecation of a name PEFT still calls
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(build(arch), LoraConfig(**config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.normal_(0, 0.1)
    model.save_pretrained(directory, safe_serialization=safe)
    return model.eval()


def base_and_adapters(root: Path, adapters: dict[str, dict]) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """The tiny Llama saved to ``root``/llama and each of ``adapters`` (name -> LoraConfig fields, the n-th
    seeded n + 1) to ``root``/name, as a model.yaml's ``lora_modules`` names them; the base and PEFT's models."""
    lm = build("llama")
    lm.save_pretrained(root / "llama")
    peft = {name: make_adapter(root / name, seed=i + 1, **config) for i, (name, config) in enumerate(adapters.items())}
    return lm, peft
