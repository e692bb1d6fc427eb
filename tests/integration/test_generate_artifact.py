"""`neuron-serve build` of a task: generate model, then `neuron-serve deploy` of the artifact:
it serves the OpenAI routes with the text transformers generates, without the transformers model."""

import subprocess
import sys

import openai
import torch
import transformers

from conftest import make_llm

CONFIG = """
name: llm
task: generate
model:
  pretrained: llm
generation:
  max_num_seqs: 4
  max_model_len: 128
  # One prefill and one decode bucket, greedy: what the one request below runs.
  prefill_buckets: [128]
  decode_batch_buckets: [4]
  decode_context_buckets: [128]
  on_device_sampling: false
"""


def test_a_built_generate_artifact_serves_what_transformers_generates(server_factory, tmp_path):
    make_llm(tmp_path / "llm")
    (tmp_path / "llm.yaml").write_text(CONFIG)
    built = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "build", str(tmp_path / "llm.yaml"), "-o",
                            str(tmp_path / "built")], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    srv = server_factory([str(tmp_path / "built")], tmp_path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "llm")
        lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llm").eval()
        ids = tokenizer("Artifacts are")["input_ids"]
        with torch.no_grad():
            out = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        expected = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as client:
            answer = client.completions.create(model="llm", prompt="Artifacts are", max_tokens=20, temperature=0)
            assert [m.id for m in client.models.list().data] == ["llm"]
        assert answer.choices[0].text == expected
    finally:
        srv.stop()
