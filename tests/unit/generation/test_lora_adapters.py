"""LoRA adapters read from PEFT's own save_pretrained directories: the delta laid out for the core, applied by
hand to the base model, gives PEFT's eager logits; every refusal names the file, the module and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import generation_models as gm
from generation_models import ATTENTION, MLP, make_adapter
from neuron_serve.errors import AdapterError, InvalidInput
from neuron_serve.generation.lora.adapter import LoraBase, buffer_bytes, read_adapter

# Four adapters of the tiny Llama: ranks 4 to 16, attention only, MLP only (rsLoRA), every projection of one
# layer, and a regular expression with a per-module rank and alpha.
ADAPTERS = {
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION},
    "mlp": {"r": 8, "lora_alpha": 16, "target_modules": MLP, "use_rslora": True},
    "layer-1": {"r": 16, "lora_alpha": 8, "target_modules": ATTENTION + MLP, "layers_to_transform": [1]},
    "regex": {"r": 8, "lora_alpha": 32, "target_modules": r".*\.(q_proj|v_proj|down_proj)",
              "rank_pattern": {"down_proj": 4}, "alpha_pattern": {"v_proj": 8}},
    # PEFT's other rules of what is targeted: one layer by its list's name, modules excluded.
    "excluded": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "up_proj"], "layers_to_transform": 0,
                 "layers_pattern": "layers", "exclude_modules": ["v_proj"]},
}
R = 16
PROMPTS = torch.randint(0, gm.VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))


def logits_with(lm: torch.nn.Module, adapter, ids: torch.Tensor) -> torch.Tensor:
    """``lm``'s logits with the adapter's delta added by hand: each targeted projection's output + x @ a @ b."""
    modules = dict(lm.named_modules())
    hooks = [modules[w.projection.module].register_forward_hook(lambda m, args, out, w=w: out + args[0] @ w.a @ w.b)
             for w in adapter.weights.values()]
    try:
        with torch.no_grad():
            return lm(ids).logits
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, PEFT's eager model) for each of ADAPTERS."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, make_adapter(root / name, seed=seed, **config))
            for seed, (name, config) in enumerate(ADAPTERS.items())}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_the_delta_applied_by_hand_gives_peft_logits(saved, name):
    directory, peft_model = saved[name]
    base = gm.build("llama")
    adapter = read_adapter(name, directory, base, max_lora_rank=R)
    with torch.no_grad():
        want, plain = peft_model(PROMPTS).logits, base(PROMPTS).logits
    got = logits_with(base, adapter, PROMPTS)
    assert (got - plain).abs().max() > 1e-2  # the adapter does change the answer
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_what_an_adapter_holds(saved):
    llama = gm.build("llama")
    read = {name: read_adapter(name, saved[name][0], llama, max_lora_rank=R) for name in ADAPTERS}
    attention, mlp, layer_1, regex, excluded = read.values()
    assert (attention.name, attention.path, attention.rank, attention.alpha, attention.use_rslora) == \
        ("attention", str(saved["attention"][0]), 4, 8, False)
    assert attention.target_modules == ("self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert sorted(attention.weights) == [(layer, f"self_attn.{p}") for layer in (0, 1) for p in sorted(ATTENTION)]
    assert (mlp.rank, mlp.use_rslora) == (8, True)
    assert mlp.target_modules == ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    assert sorted(layer_1.weights) == sorted((1, n) for n in layer_1.target_modules) and len(layer_1.weights) == 7
    assert regex.target_modules == ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert sorted(excluded.weights) == [(0, "mlp.up_proj"), (0, "self_attn.q_proj")]
    # Per layer, (in + out) x R float32 values a projection: q and o 64 + 64, k and v 64 + 32 (2 kv heads of 16).
    assert attention.nbytes == 2 * (128 + 96 + 96 + 128) * R * 4

    q = attention.weights[0, "self_attn.q_proj"]
    assert (q.projection.module, q.projection.in_features, q.projection.out_features) == \
        ("model.layers.0.self_attn.q_proj", 64, 64)
    assert (q.a.shape, q.b.shape, q.a.dtype, q.b.dtype) == ((64, R), (R, 64), torch.float32, torch.float32)
    stored = load_file(saved["attention"][0] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    assert torch.equal(q.a[:, :4], stored[key.format("A")].T) and not q.a[:, 4:].any()
    torch.testing.assert_close(q.b[:4], stored[key.format("B")].T * (8 / 4), rtol=0, atol=0)
    assert not q.b[4:].any()
    down = mlp.weights[1, "mlp.down_proj"]  # rsLoRA: alpha / sqrt(r)
    torch.testing.assert_close(down.b[:8], load_file(saved["mlp"][0] / "adapter_model.safetensors")[
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].T * (16 / 8 ** 0.5))
    # rank_pattern and alpha_pattern: down_proj at rank 4, v_proj's scaling 8 / 8 where q_proj's is 32 / 8.
    assert not regex.weights[0, "mlp.down_proj"].a[:, 4:].any() and regex.weights[0, "mlp.down_proj"].a[:, :4].any()
    stored = load_file(saved["regex"][0] / "adapter_model.safetensors")
    for name, scaling in (("v_proj", 8 / 8), ("q_proj", 32 / 8)):
        torch.testing.assert_close(regex.weights[0, f"self_attn.{name}"].b[:8], stored[
            f"base_model.model.model.layers.0.self_attn.{name}.lora_B.weight"].T * scaling)


def test_a_bfloat16_model_gets_bfloat16_buffers(saved):
    adapter = read_adapter("mlp", saved["mlp"][0], gm.build("llama").to(torch.bfloat16), max_lora_rank=8)
    assert {(w.a.dtype, w.b.dtype) for w in adapter.weights.values()} == {(torch.bfloat16, torch.bfloat16)}
    assert adapter.nbytes == 2 * ((64 + 128) * 2 + (128 + 64)) * 8 * 2


ZOO_TARGETS = {
    "llama": ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
              "self_attn.q_proj", "self_attn.v_proj"),
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "phi": ("mlp.fc1", "mlp.fc2", "self_attn.dense", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"),
    "gpt_neox": ("attention.dense", "attention.query_key_value", "mlp.dense_4h_to_h", "mlp.dense_h_to_4h"),
}


@pytest.mark.parametrize("arch", list(gm.CONFIGS))
def test_every_architecture_of_the_zoo_takes_adapters_on_all_its_projections(tmp_path, arch):
    """PEFT's all-linear (every linear layer but the head): GPT-2's Conv1D (weights stored transposed),
    GPT-NeoX's fused query_key_value, Phi's dense and fc1/fc2 alike."""
    peft_model = make_adapter(tmp_path, arch, r=8, lora_alpha=16, target_modules="all-linear",
                              fan_in_fan_out=arch == "gpt2")
    base = gm.build(arch)
    adapter = read_adapter("all", tmp_path, base, max_lora_rank=R)
    assert adapter.target_modules == ZOO_TARGETS.get(arch, ZOO_TARGETS["llama"])
    with torch.no_grad():
        want = peft_model(PROMPTS).logits
    torch.testing.assert_close(logits_with(base, adapter, PROMPTS), want, rtol=0, atol=1e-5)
    # save_pretrained writes the module names all-linear stood for; the shorthand itself reaches the same.
    edit_config(tmp_path, target_modules="all-linear")
    shorthand = read_adapter("all", tmp_path, base, max_lora_rank=R)
    assert sorted(shorthand.weights) == sorted(adapter.weights)


def test_buffer_bytes_per_core_and_over_a_tensor_parallel_group():
    llama = gm.build("llama")
    # q, k, v, o, gate, up, down: (in + out) values at each rank, two layers, float32.
    whole = (64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64)
    assert buffer_bytes(llama, 4, 16) == 4 * 2 * whole * 16 * 4
    # Over 2 cores: q, k, v, gate, up split B's output features (colwise), o and down A's input features.
    split = (64 + 32) + (64 + 16) * 2 + (32 + 64) + (64 + 64) * 2 + (64 + 64)
    tp = LoraBase.of(llama, 2)
    assert [(p.name, p.split) for p in tp.projections if p.layer == 0] == [
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")]
    assert buffer_bytes(tp, 4, 16) == 4 * 2 * split * 16 * 4
    # With fewer key/value heads than cores, k and v (and their adapters' buffers) stay whole on every core.
    narrow = LoraBase.of(gm.build("llama", num_key_value_heads=1), 2)
    assert {p.name: p.split for p in narrow.projections}["self_attn.k_proj"] is None
    gpt2 = (64 + 192) + (64 + 64) + (64 + 256) + (256 + 64)
    assert buffer_bytes(gm.build("gpt2"), 1, 8) == 2 * gpt2 * 8 * 4


# -- refusals -------------------------------------------------------------------------------------

def edit_config(directory: Path, **changes) -> None:
    file = directory / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def edit_weights(directory: Path, drop: str | None = None, add: str | None = None) -> None:
    file = directory / "adapter_model.safetensors"
    tensors = load_file(file)
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.ones(4, 64)
    save_file(tensors, file)


CONFIG, WEIGHTS = "{d}/adapter_config.json", "{d}/adapter_model.safetensors"
PROJECTIONS = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
ANOTHER = "the adapter is of another base model: serve it on the model it was trained for."
AGAIN = "save the adapter again with save_pretrained."
KEY = "base_model.model.model.layers.0.self_attn.{}.weight"

# (id, the adapter: from ADAPTERS or made, then a change; max_lora_rank; base overrides; the exact message)
REFUSED = [
    ("rank over the maximum", "layer-1", None, 8, {},
     f"{CONFIG}: r is 16, more than generation.lora.max_lora_rank (8); set generation.lora.max_lora_rank to 16, or "
     f"serve an adapter of rank at most 8."),
    ("rank over any maximum", "attention", lambda d: edit_config(d, r=600), R, {},
     f"{CONFIG}: r is 600, more than generation.lora.max_lora_rank (16); no generation.lora.max_lora_rank reaches it "
     f"(at most 512), or serve an adapter of rank at most 16."),
    ("a rank_pattern over the maximum", "regex", lambda d: edit_config(d, rank_pattern={"down_proj": 32}), R, {},
     f"{CONFIG}: rank_pattern gives a module rank 32, more than generation.lora.max_lora_rank (16); set "
     f"generation.lora.max_lora_rank to 32, or serve an adapter of rank at most 16."),
    ("a target the model lacks", {"arch": "gpt_neox", "target_modules": ["query_key_value"]}, None, R, {},
     f"{CONFIG}: target_modules names query_key_value, which the model (LlamaForCausalLM) has no module of; the "
     f"adapter is of another base model (this one's projections: {PROJECTIONS})."),
    ("a regular expression reaching nothing", "attention", lambda d: edit_config(d, target_modules=r".*\.wq"), R, {},
     f"{CONFIG}: target_modules '.*\\.wq' reach no module of the model (LlamaForCausalLM); the adapter is of "
     f"another base model (this one's projections: {PROJECTIONS})."),
    ("another base model's input features", "attention", None, R, {"hidden_size": 32},
     f"{WEIGHTS}: model.layers.0.self_attn.k_proj: lora_A is (4, 64), but the model's k_proj takes 32 input features "
     f"(lora_A would be (4, 32)); {ANOTHER}"),
    ("another base model's output features", {"target_modules": ["up_proj"], "r": 8}, None, R,
     {"intermediate_size": 96},
     f"{WEIGHTS}: model.layers.0.mlp.up_proj: lora_B is (128, 8), but the model's up_proj gives 96 output features "
     f"(lora_B would be (96, 8)); {ANOTHER}"),
    ("weights of a module the model lacks", "attention",
     lambda d: edit_weights(d, add="base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"), R, {},
     f"{WEIGHTS}: model.layers.7.self_attn.q_proj: the model (LlamaForCausalLM) has no such module; {ANOTHER}"),
    ("DoRA", {"target_modules": ["q_proj"], "use_dora": True}, None, R, {},
     f"{CONFIG}: use_dora: DoRA adapters are not served (their magnitude vectors rescale each targeted layer's "
     f"weight); train a plain LoRA adapter (use_dora false)."),
    ("modules_to_save", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, None, R, {},
     f"{CONFIG}: modules_to_save: the adapter carries trained copies of ['lm_head'], which are not served per "
     f"adapter; train without modules_to_save, or merge the adapter into its model (merge_and_unload) and serve "
     f"that as a model of its own."),
    ("trained biases", {"target_modules": ["q_proj"], "bias": "lora_only"}, None, R, {},
     f"{CONFIG}: bias: 'lora_only' trains the base model's biases, which are not served per adapter; train with "
     f"bias \"none\"."),
    ("a bias on lora_B", "attention", lambda d: edit_config(d, lora_bias=True), R, {},
     f"{CONFIG}: lora_bias: a bias on lora_B is not served; train with lora_bias false."),
    ("an embedding target", "attention", lambda d: edit_config(d, target_modules=["embed_tokens"]), R, {},
     f"{CONFIG}: target_modules reach model.embed_tokens (Embedding): embedding and LM head targets are not served; "
     f"train the adapter on the attention and MLP projections ({PROJECTIONS})."),
    ("an LM head target", "attention", lambda d: edit_config(d, target_modules=["q_proj", "lm_head"]), R, {},
     f"{CONFIG}: target_modules reach lm_head (Linear): embedding and LM head targets are not served; train the "
     f"adapter on the attention and MLP projections ({PROJECTIONS})."),
    ("a module that is no projection", "attention", lambda d: edit_config(d, target_modules=["mlp"]), R, {},
     f"{CONFIG}: target_modules reach model.layers.0.mlp (LlamaMLP), which is not an attention or MLP projection; "
     f"train the adapter on those ({PROJECTIONS})."),
    ("a PiSSA adapter saved unconverted", "attention", lambda d: edit_config(d, init_lora_weights="pissa"), R, {},
     f"{CONFIG}: init_lora_weights: 'pissa' trains the adapter against changed base weights; save it converted to a "
     f"plain LoRA adapter (save_pretrained(..., path_initial_model_for_weight_conversion=...)) and serve that."),
    ("another kind of adapter", "attention", lambda d: edit_config(d, peft_type="IA3"), R, {},
     f"{CONFIG}: peft_type is 'IA3'; only LoRA adapters (peft_type \"LORA\") are served."),
    ("pickled weights only", {"target_modules": ["q_proj"], "safe": False}, None, R, {},
     "{d}/adapter_model.bin: the adapter's weights are pickled, and neuron-serve does not unpickle; save the adapter "
     "with save_pretrained(..., safe_serialization=True) (the default), which writes adapter_model.safetensors."),
    ("no weights", "attention", lambda d: (d / "adapter_model.safetensors").unlink(), R, {},
     f"{WEIGHTS}: no such file; a PEFT adapter directory holds its weights there (save the adapter with "
     f"save_pretrained)."),
    ("unreadable weights", "attention", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x08" + b"\0" * 15),
     R, {}, f"{WEIGHTS}: not a safetensors file ("),
    ("no adapter_config.json", "attention", lambda d: (d / "adapter_config.json").unlink(), R, {},
     f"{CONFIG}: no such file; a PEFT adapter directory holds its LoraConfig there (save the adapter with "
     f"save_pretrained)."),
    ("a malformed adapter_config.json", "attention", lambda d: (d / "adapter_config.json").write_text("{not json"),
     R, {}, f"{CONFIG}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
            f"{AGAIN}"),
    ("adapter_config.json not an object", "attention", lambda d: (d / "adapter_config.json").write_text("[8]"), R, {},
     f"{CONFIG}: must hold a JSON object (PEFT's LoraConfig), not a list; {AGAIN}"),
    ("a rank of the wrong type", "attention", lambda d: edit_config(d, r="8"), R, {},
     f"{CONFIG}: r must be a positive integer, got '8'; {AGAIN}"),
    ("an invalid regular expression", "attention", lambda d: edit_config(d, target_modules="(q_proj"), R, {},
     f"{CONFIG}: target_modules: '(q_proj' is not a regular expression (missing ), unterminated subpattern at "
     f"position 0); give a list of module names or a valid regular expression."),
    ("files of two adapters: a rank", "attention", lambda d: edit_config(d, r=8), R, {},
     f"{WEIGHTS}: model.layers.0.self_attn.k_proj: lora_A is (4, 64), of rank 4, but adapter_config.json gives the "
     f"module rank 8; the two files are of different adapters: {AGAIN}"),
    ("files of two adapters: a module not targeted", "attention", lambda d: edit_config(d, target_modules=["q_proj"]),
     R, {}, f"{WEIGHTS}: model.layers.0.self_attn.k_proj: adapter_config.json's target_modules do not reach it, so "
            f"the two files are of different adapters; {AGAIN}"),
    ("a targeted module without weights", "attention", lambda d: edit_weights(d, drop=KEY.format("v_proj.lora_B")),
     R, {}, f"{WEIGHTS}: model.layers.0.self_attn.v_proj: lora_B.weight is missing, though adapter_config.json's "
            f"target_modules reach it; {AGAIN}"),
    ("a DoRA weight", "attention", lambda d: edit_weights(d, add=KEY.format("q_proj.lora_magnitude_vector")), R, {},
     f"{WEIGHTS}: {KEY.format('q_proj.lora_magnitude_vector')} is not a LoRA weight (base_model.model.<module>."
     f"lora_A.weight or lora_B.weight); serve a plain LoRA adapter, as PEFT's save_pretrained writes it."),
]


@pytest.mark.parametrize("adapter,change,max_lora_rank,base,text", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refused_with_the_file_and_the_fix(saved, tmp_path, adapter, change, max_lora_rank, base, text):
    directory = tmp_path / "adapter"
    if isinstance(adapter, str):
        shutil.copytree(saved[adapter][0], directory)
    else:
        make_adapter(directory, **adapter)
    if change is not None:
        change(directory)
    with pytest.raises(AdapterError) as err:
        read_adapter("sql", directory, gm.build("llama", **base), max_lora_rank=max_lora_rank)
    text = text.format(d=directory)
    assert str(err.value)[:len(text) if text.endswith("(") else None] == text  # the whole text, or the start given
    assert isinstance(err.value, InvalidInput) and err.value.http_status == 400


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(AdapterError) as err:
        read_adapter("sql", tmp_path / "nowhere", gm.build("llama"))
    assert str(err.value) == (f"{tmp_path}/nowhere: not a directory; give a PEFT adapter directory "
                              f"(adapter_config.json and adapter_model.safetensors, as save_pretrained writes them).")
