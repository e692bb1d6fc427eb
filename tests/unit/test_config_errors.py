"""Invalid model.yaml files: each error names the field and how to fix it."""

import copy

import pytest

from neuron_serve.config.schema import AUTH_TOKEN_ENV, load_config, parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.serve.http.auth import authorized, resolve_token

VALID = {
    "name": "mlp",
    "model": {"factory": "example_models.mlp:build"},
    "inputs": [{"name": "x", "shape": [32, 784], "dtype": "float32"}],
}


def variant(path: str, value) -> dict:
    """VALID with the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    data = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if value is ...:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


CASES = [
    # (what is wrong, the variant, text the message must contain)
    ("name missing", variant("name", ...), "name: Field required (add it)"),
    ("name with capitals", variant("name", "MyModel"), "name: String should match pattern"),
    ("name too long", variant("name", "a" * 64), "name: String should match pattern"),
    ("model missing", variant("model", ...), "model: Field required"),
    ("factory without colon", variant("model.factory", "example_models.mlp"), "model.factory: String should match"),
    ("factory not a string", variant("model.factory", 3), "model.factory: Input should be a valid string"),
    ("unknown model key", variant("model.kwarg", {}), "model.kwarg: Extra inputs are not permitted (remove it"),
    ("inputs empty", variant("inputs", []), "inputs: List should have at least 1 item"),
    ("input without name", variant("inputs.0.name", ...), "inputs.0.name: Field required"),
    ("input shape with zero", variant("inputs.0.shape", [0, 784]), "inputs.0.shape: Value error, every dimension must be >= 1"),
    ("input shape negative", variant("inputs.0.shape", [-1, 784]), "inputs.0.shape: Value error, every dimension must be >= 1"),
    ("input shape not a list", variant("inputs.0.shape", "32x784"), "inputs.0.shape: Input should be a valid list"),
    ("unknown dtype", variant("inputs.0.dtype", "float64"), "inputs.0.dtype: Input should be 'float32'"),
    ("duplicate input names", variant("inputs", [{"name": "x", "shape": [1]}, {"name": "x", "shape": [1]}]),
     "input names must be unique"),
    ("unknown target", variant("target", "gpu"), "target: Input should be 'neuron' or 'xla' (use one of the values listed)"),
    ("typo at top level", variant("targte", "xla"), "targte: Extra inputs are not permitted (remove it or check its spelling)"),
    ("threshold above 1", variant("partitioner.model_support_percentage_threshold", 1.5),
     "partitioner.model_support_percentage_threshold: Input should be less than or equal to 1"),
    ("cores zero", variant("cores_per_replica", 0), "cores_per_replica: Input should be greater than or equal to 1"),
    ("replicas not a number", variant("replicas", "two"), "replicas: Input should be a valid integer"),
    ("autoscaling bounds inverted", variant("autoscaling", {"min_replicas": 3, "max_replicas": 1}),
     "autoscaling: Value error, max_replicas (1) must be >= min_replicas (3)"),
    ("max batch zero", variant("batching.max_batch_size", 0), "batching.max_batch_size: Input should be greater than or equal to 1"),
    ("negative queue delay", variant("batching.max_queue_delay_ms", -1), "batching.max_queue_delay_ms: Input should be greater than or equal to 0"),
    ("queue size zero", variant("batching.max_queue_size", 0), "batching.max_queue_size: Input should be greater than or equal to 1"),
    ("zero timeout", variant("batching.request_timeout_s", 0), "batching.request_timeout_s: Input should be greater than 0"),
    ("port out of range", variant("http.port", 70000), "http.port: Input should be less than or equal to 65535"),
    ("tiny body limit", variant("http.max_request_bytes", 10), "http.max_request_bytes: Input should be greater than or equal to 1024"),
    ("auth env var name invalid", variant("http.auth", {"token_env": "MY-TOKEN"}), "http.auth.token_env: String should match pattern"),
    ("auth with two sources", variant("http.auth", {"token_env": "A", "token_file": "/t"}),
     "http.auth: Value error, give token_env or token_file, not both"),
    ("auth unknown key", variant("http.auth", {"token": "secret"}), "http.auth.token: Extra inputs are not permitted"),
    ("buckets name an unknown input", variant("buckets", {"sizes": [8], "inputs": {"y": 1}}),
     "buckets name unknown inputs ['y']"),
    ("buckets without sizes", variant("buckets", {"sizes": [], "inputs": {"x": 1}}), "buckets.sizes: List should have at least 1 item"),
    ("batch sizes neither a list nor auto", variant("batch_sizes", "some"),
     "batch_sizes: Input should be 'auto' (use one of the values listed)"),
    ("batch sizes auto without dynamic batch", {**variant("batch_sizes", "auto"), "dynamic_batch": False},
     "batch_sizes needs dynamic_batch: true"),
    ("learn_buckets_after without batch sizes auto", variant("learn_buckets_after", 10),
     "learn_buckets_after: applies to batch_sizes: auto; set batch_sizes: auto or remove learn_buckets_after"),
    ("batch sizes auto for a pooling model", {**variant("batch_sizes", "auto"), "task": "embed",
                                              "model": {"pretrained": "/models/minilm"}, "inputs": None},
     "batch_sizes: auto applies to task: infer (it learns from the rows of its chunks); a task: embed model learns "
     "its buckets with pooling.length_buckets: auto; give a list"),
    ("max_batch_tokens for a model of tensors", variant("batching.max_batch_tokens", 4096),
     "batching.max_batch_tokens: applies to task: embed, score or classify, whose texts are counted in tokens; a "
     "task: infer batch is counted in rows (max_batch_size); remove it"),
]


@pytest.mark.parametrize("data,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_variant_names_the_field(data, text):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "model.yaml")
    message = str(err.value)
    assert message.startswith("model.yaml: invalid model.yaml\n")
    assert text in message, message


def test_at_least_twenty_variants():
    assert len(CASES) >= 20


def test_not_a_mapping_says_what_the_top_level_needs():
    with pytest.raises(ConfigError, match="the top level must be a mapping with 'name', 'model' and 'inputs'"):
        parse_config(["name", "mlp"])


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{path}: not valid YAML"):
        load_config(path)


def test_valid_base_parses():
    assert parse_config(VALID).name == "mlp"


# -- authentication settings ------------------------------------------------------------

TOKEN = "0123456789abcdef-token"


def with_auth(auth):
    return parse_config(variant("http.auth", auth))


def test_auth_off_by_default():
    assert resolve_token(parse_config(VALID), environ={}) is None


def test_auth_from_the_default_environment_variable():
    assert resolve_token(parse_config(VALID), environ={AUTH_TOKEN_ENV: TOKEN}) == TOKEN
    assert resolve_token(None, environ={AUTH_TOKEN_ENV: TOKEN}) == TOKEN


def test_auth_from_a_named_variable_and_a_file(tmp_path):
    assert resolve_token(with_auth({"token_env": "MY_TOKEN"}), environ={"MY_TOKEN": TOKEN}) == TOKEN
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert resolve_token(with_auth({"token_file": str(secret)}), environ={}) == TOKEN


@pytest.mark.parametrize("auth,environ,text", [
    ({"token_env": "MY_TOKEN"}, {}, "http.auth.token_env: environment variable MY_TOKEN is not set or empty"),
    ({}, {}, f"http.auth.token_env: environment variable {AUTH_TOKEN_ENV} is not set or empty"),
    ({"token_file": "/nonexistent/token"}, {}, "http.auth.token_file: cannot read '/nonexistent/token'"),
    ({"token_env": "MY_TOKEN"}, {"MY_TOKEN": "short"}, "http.auth.token_env: the token has 5 characters; use at least 16"),
])
def test_auth_without_a_usable_token_is_refused(auth, environ, text):
    with pytest.raises(ConfigError) as err:
        resolve_token(with_auth(auth), environ=environ)
    assert text in str(err.value)


def test_short_token_in_the_environment_is_refused():
    with pytest.raises(ConfigError, match=rf"\${AUTH_TOKEN_ENV}: the token has 3 characters"):
        resolve_token(None, environ={AUTH_TOKEN_ENV: "abc"})


@pytest.mark.parametrize("header,ok", [
    (f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True), (f"Bearer  {TOKEN} ", True),
    (None, False), ("", False), (f"Basic {TOKEN}", False), (f"Bearer {TOKEN[:-1]}", False),
    (f"Bearer {TOKEN}0", False), (TOKEN, False), ("Bearer ", False),
])
def test_authorized(header, ok):
    assert authorized(header, TOKEN) is ok
