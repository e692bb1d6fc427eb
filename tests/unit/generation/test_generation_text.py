"""Incremental output text: never half a character, never a stop string, the same text streamed or whole."""

from __future__ import annotations

import pytest

import generation_models as gm
from neuron_serve.generation.frontend import text as text_module
from neuron_serve.generation.frontend.text import IncrementalText, _decode_stream


@pytest.fixture(scope="module")
def tokenizer():
    return gm.byte_tokenizer()  # one token per byte: every multi-byte character spans several tokens


@pytest.fixture(autouse=True, params=["rust", "python"])
def decoding(request, monkeypatch, tokenizer):
    """Every test runs with tokenizers' DecodeStream and with the Python decodes a tokenizer
    without one (or one that cleans up spaces) gets."""
    if request.param == "python":
        monkeypatch.setattr(text_module, "_decode_stream", lambda tokenizer: (None, None))
    else:
        assert text_module._decode_stream(tokenizer)[0] is not None
    return request.param


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalText]:
    out = IncrementalText(tokenizer, stop)
    deltas = [out.add(t) for t in ids(tokenizer, text)]
    if out.stopped is None:
        deltas.append(out.finish())
    return deltas, out


def test_multi_byte_characters_are_never_split(tokenizer):
    text = "héllo wörld ✓ 日本"
    assert len(ids(tokenizer, text)) > len(text)  # several tokens for some characters
    deltas, out = stream(tokenizer, text)
    assert "".join(deltas) == text == out.text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # a token ending mid-character releases nothing yet


def test_a_stop_string_ends_the_text_before_it_and_never_leaks(tokenizer):
    deltas, out = stream(tokenizer, "one, two. STOP three", stop=("STOP",))
    assert out.stopped == "STOP"
    assert "".join(deltas) == out.text == "one, two. "
    # The possible start of a stop string is held back until it is ruled out.
    deltas, out = stream(tokenizer, "a ST b STO c", stop=("STOP",))
    assert out.stopped is None and "".join(deltas) == "a ST b STO c"
    assert deltas[ids(tokenizer, "a ST b STO c").index(ids(tokenizer, "T")[0])] == ""  # "ST" waited


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, out = stream(tokenizer, "xx ✓ end yy", stop=("yy", "✓"))
    assert (out.stopped, "".join(deltas)) == ("✓", "xx ")


@pytest.mark.parametrize("seed", range(20))
def test_random_tokens_stream_to_exactly_their_whole_decode(tokenizer, seed):
    """What a random model emits, invalid byte runs included: the streamed deltas and the
    final text both equal the tokenizer's decode of every token."""
    import random

    rng = random.Random(seed)
    tokens = [rng.randrange(gm.VOCAB) for _ in range(60)]
    out = IncrementalText(tokenizer)
    deltas = [out.add(t) for t in tokens] + [out.finish()]
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    assert "".join(deltas) == whole == out.text


def test_a_tokenizer_that_cleans_up_spaces_decodes_in_python(tokenizer, monkeypatch):
    assert _decode_stream(tokenizer)[0] is not None  # the module's own choice, whatever the fixture patched
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert _decode_stream(tokenizer) == (None, None)

