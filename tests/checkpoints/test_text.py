"""Text in and out: our tokenizer use agrees with transformers (goldens), and streamed text is
UTF-8 safe across token boundaries."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from gpu_worker.checkpoints.text import TextCodec

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def codec():
    return TextCodec.for_checkpoint(GOLDEN / "llama-tied")


def test_encode_and_decode_agree_with_transformers(codec):
    g = np.load(GOLDEN / "tokenizer.npz")
    for text, ids, decoded in zip(g["texts"], g["ids"], g["decoded"]):
        want = [int(i) for i in ids if i >= 0]
        assert codec.encode(str(text)) == want, f"ids of {text!r}"
        assert codec.decode(want) == str(decoded) == str(text), f"round trip of {text!r}"


def test_streamed_text_concatenates_to_the_decoded_output(codec):
    text = "naïve café 日本語 🙂 done"
    ids = codec.encode(text)
    assert len(ids) > len(text.encode()) // 2, "multi-byte characters must span several tokens"
    stream = codec.stream()
    pieces = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(pieces) == codec.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), "a piece carried half a character"


def test_a_stream_cut_mid_character_flushes_a_replacement_at_finish(codec):
    ids = codec.encode("🙂")
    stream = codec.stream()
    assert stream.push(ids[:-1]) == "", "an incomplete character must be held back"
    assert stream.finish() == "\ufffd" * (codec.decode(ids[:-1]).count("\ufffd"))


def test_a_checkpoint_without_tokenizer_json_has_no_codec():
    assert TextCodec.for_checkpoint(GOLDEN / "qwen2-tied") is None
