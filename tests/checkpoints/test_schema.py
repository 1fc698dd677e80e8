"""Checkpoint configs and safetensors headers are validated as a schema before anything is built:
every malformed value is INVALID_ARGUMENT (a domain error), never ZeroDivisionError,
OverflowError, RecursionError or TypeError (INTERNAL); sizes are bounded so a hostile config
costs nothing to refuse; and a load the host cannot hold is refused before it starts."""
from __future__ import annotations

import json
import math
import pathlib
import shutil
import struct
import time
import tracemalloc

import pytest

from gpu_worker.checkpoints import Checkpoint, CheckpointError, budget, schema
from gpu_worker.checkpoints.safetensors import SafetensorsFile
from services.common.errors import InvalidArgument, ResourceExhausted

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture
def ckpt(tmp_path):
    return pathlib.Path(shutil.copytree(GOLDEN / "llama-tied", tmp_path / "llama"))


def _config(directory: pathlib.Path, text: str | None = None, **changes) -> None:
    if text is None:
        cfg = json.loads((directory / "config.json").read_text())
        cfg.update(changes)
        text = json.dumps(cfg)   # writes inf / nan as Infinity / NaN, as a careless tool would
    (directory / "config.json").write_text(text)


def _refused(directory: pathlib.Path, match: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument, match=match) as err:
        Checkpoint.open(directory, 256).close()
    return err.value


def test_zero_heads_is_invalid_argument(ckpt):
    _config(ckpt, num_attention_heads=0)
    _refused(ckpt, "num_attention_heads is 0; it must be between 1 and 1024")


def test_zero_layers_is_invalid_argument(ckpt):
    _config(ckpt, num_hidden_layers=0)
    _refused(ckpt, "num_hidden_layers is 0")


def test_zero_kv_heads_is_invalid_argument(ckpt):
    _config(ckpt, num_key_value_heads=0)
    _refused(ckpt, "num_key_value_heads is 0; it must be between 1 and 4")


def test_a_million_layers_is_refused_before_any_allocation(ckpt):
    """Before the bound: 28-33 s and ~3 GiB of RSS, building a million layers' tensor list."""
    _config(ckpt, num_hidden_layers=1_000_000)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _refused(ckpt, "num_hidden_layers is 1000000; it must be between 1 and 1024")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 8 << 20, f"refusing the config allocated {peak} bytes"


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "intermediate_size",
                                   "max_position_embeddings", "num_hidden_layers"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, -1, 2**63, 32.5, True,
                                   "32", [32], None])
def test_sizes_that_are_not_positive_bounded_integers_are_invalid_argument(ckpt, field, value):
    if value is None and field == "max_position_embeddings":
        pytest.skip("optional: null takes the served context")
    _config(ckpt, **{field: value})
    is_constant = isinstance(value, float) and not math.isfinite(value)   # NaN, Infinity
    _refused(ckpt, "is not a finite number" if is_constant else field)


@pytest.mark.parametrize("value", [5, "LlamaForCausalLM", [5], {"a": 1}])
def test_architectures_must_be_a_list_of_strings(ckpt, value):
    _config(ckpt, architectures=value)
    _refused(ckpt, "architectures must be a list of strings")


@pytest.mark.parametrize("value", [[1, 2], "default", 3])
def test_rope_parameters_must_be_an_object(ckpt, value):
    _config(ckpt, rope_parameters=value)
    _refused(ckpt, "rope_parameters must be a JSON object")


@pytest.mark.parametrize("theta", [0, -1.0, float("inf"), "big", 1e13])
def test_rope_theta_must_be_finite_and_positive(ckpt, theta):
    _config(ckpt, rope_parameters={"rope_type": "default", "rope_theta": theta})
    _refused(ckpt, "Infinity is not a finite number" if theta == float("inf") else "rope_theta")


def test_llama3_scaling_with_equal_frequency_factors_is_invalid_argument(ckpt):
    """inv_freq divides by high_freq_factor - low_freq_factor."""
    _config(ckpt, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                   "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64})
    _refused(ckpt, "high_freq_factor is 4.0; it must be finite, above 4.0")


@pytest.mark.parametrize("eps", [0, -1e-5, float("nan"), 2.0])
def test_norm_eps_must_be_in_zero_one(ckpt, eps):
    _config(ckpt, rms_norm_eps=eps)
    _refused(ckpt, "NaN is not a finite number" if math.isnan(eps) else "rms_norm_eps")


@pytest.mark.parametrize("value", [True, 1, "yes"])
def test_tie_word_embeddings_must_be_a_boolean(ckpt, value):
    if value is True:
        Checkpoint.open(ckpt, 256).close()   # the golden's own value: the negative control
        return
    _config(ckpt, tie_word_embeddings=value)
    _refused(ckpt, "tie_word_embeddings must be true or false")


@pytest.mark.parametrize("eos", [-1, 2**31, 1.5, "2", [2, "x"], list(range(2000))])
def test_eos_token_ids_are_bounded_integers(ckpt, eos):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    _refused(ckpt, "generation_config.json: eos_token_id must be a token id")


def test_quantization_config_fields_are_typed(ckpt):
    _config(ckpt, quantization_config={"quant_method": "gptq", "bits": "4", "sym": True})
    _refused(ckpt, "quantization_config: bits is not a number")
    _config(ckpt, quantization_config=[1])
    _refused(ckpt, "quantization_config must be a JSON object")


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "nests 100000 levels deep"),
    ('{"a": ' * 40 + "1" + "}" * 40, "nests 40 levels deep"),
    ('{"hidden_size": 1e400}', "not a finite float"),
    ('{"hidden_size": NaN}', "NaN is not a finite number"),
    ('{"hidden_size": -Infinity}', "-Infinity is not a finite number"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "beyond 64 bits"),
    ('{"hidden_size": 32', "not UTF-8 JSON"),
    ("[1, 2]", "config.json is not a JSON object"),
])
def test_hostile_json_is_invalid_argument(ckpt, text, says):
    _config(ckpt, text)
    _refused(ckpt, says)


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert schema.json_depth(b'{"a": "[[[[{{{{", "b": ["\\"]]]"]}') == 2
    assert schema.json_depth(b'["a\\\\", [[]]]') == 3, "an escaped backslash ends no string"


def test_the_depth_scan_is_linear_on_an_unterminated_string_of_escaped_quotes(ckpt):
    """A pattern that can fail rescans the rest from every escaped quote: hours for 1 MiB."""
    text = '{"a": "' + '\\"' * 300_000
    t0 = time.perf_counter()
    _config(ckpt, text)
    _refused(ckpt, "not UTF-8 JSON")
    assert time.perf_counter() - t0 < 5.0


def _header(path: pathlib.Path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)


def _f32(shape, begin=0, end=None) -> dict:
    return {"w": {"dtype": "F32", "shape": shape, "data_offsets": [begin, end if end is not None else 16]}}


@pytest.mark.parametrize("header, says", [
    (_f32([2**40, 2**24], 0, 0), r"needs 73786976294838206464"),  # int64: 2^66 wraps to 0
    (_f32([2**59, 32], 0, 0), "integers between 0 and 2"),
    (_f32([-4]), "integers between 0 and 2"),
    (_f32([4.0]), "integers between 0 and 2"),
    (_f32([True, 4]), "integers between 0 and 2"),
    (_f32([1] * 9), "at most 8"),
    (_f32([2**60]), "integers between 0 and 2"),
    (_f32("4"), "shape '4'"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}}, "data_offsets"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, "data_offsets"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, "data_offsets"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**70]}}, "beyond 64 bits"),
    ({"w": {"dtype": 5, "shape": [4], "data_offsets": [0, 16]}}, "dtype 5 is not supported"),
    ({"w": [1, 2]}, "entry lacks dtype"),
    ({"__metadata__": [1], "w": _f32([4])["w"]}, "__metadata__"),
    ({"__metadata__": {"a": 1}}, "__metadata__"),
])
def test_a_hostile_safetensors_header_is_invalid_argument(tmp_path, header, says):
    _header(tmp_path / "m.safetensors", header, b"\0" * 16)
    with pytest.raises(CheckpointError, match=says):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_a_header_inf_offset_is_invalid_argument(tmp_path):
    blob = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, Infinity]}}'
    _header(tmp_path / "m.safetensors", blob, b"\0" * 16)
    with pytest.raises(CheckpointError, match="Infinity is not a finite number"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_a_deeply_nested_header_is_invalid_argument(tmp_path):
    _header(tmp_path / "m.safetensors", b'{"w": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    with pytest.raises(CheckpointError, match="nests 50001 levels deep"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_a_header_length_beyond_the_file_is_refused_without_reading(tmp_path):
    _header(tmp_path / "m.safetensors", b"{}", length=2**63)
    with pytest.raises(CheckpointError, match="does not fit the file"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_a_wrapping_shape_in_a_golden_header_is_refused(ckpt):
    """The int64 product of [2^40, 2^24] x 4 bytes is 0: before, a zero-length range passed."""
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = "model.norm.weight"
    begin = header[name]["data_offsets"][0]
    header[name] = {"dtype": "F32", "shape": [2**40, 2**24], "data_offsets": [begin, begin]}
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    with pytest.raises(CheckpointError, match=f"tensor '{name}': header says 0 bytes"):
        Checkpoint.open(ckpt, 256)


def test_a_load_the_host_cannot_hold_is_resource_exhausted_before_converting(ckpt):
    with Checkpoint.open(ckpt, 256) as c:
        need = budget.host_bytes(c.cfg, 1, 8, 1 << 21)
    assert need > c.cfg.weight_bytes(), "the pinned weights are part of it"
    with pytest.raises(ResourceExhausted, match="GiB of host memory") as err:
        Checkpoint.open(ckpt, 256, host_memory_limit=need // 2)
    assert err.value.zone == "host" and err.value.asked_bytes > need // 2


def test_the_host_estimate_of_405b_shapes_is_what_its_weights_take():
    """Llama 3.1 405B's shapes fit every bound, and in int4 need ~230 GB of host memory."""
    from gpu_worker.models.configs import ModelConfig
    cfg = ModelConfig("405b", "decoder", vocab_size=128256, hidden=16384, layers=126, heads=128,
                      kv_heads=8, ffn=53248, max_context=8192)
    need = budget.host_bytes(cfg, 16, 8, 1 << 21)
    assert cfg.weight_bytes() < need < cfg.weight_bytes() * 1.05 + (16 << 30)
    assert 200e9 < need < 260e9
    assert all(v <= bound for v, bound in ((126, schema.MAX_LAYERS), (16384, schema.MAX_HIDDEN),
                                           (128, schema.MAX_HEADS), (53248, schema.MAX_FFN),
                                           (128256, schema.MAX_VOCAB)))
