"""Bad checkpoints are refused before anything is converted, naming the file and the tensor."""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from gpu_worker.checkpoints import Checkpoint, CheckpointError, write_safetensors
from gpu_worker.checkpoints.safetensors import SafetensorsFile
from gpu_worker.models.weights import weight_names
from services.common.errors import FailedPrecondition, InvalidArgument

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of the tied Llama golden (single file)."""
    return pathlib.Path(shutil.copytree(GOLDEN / "llama-tied", tmp_path / "llama"))


def _edit_config(directory: pathlib.Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (directory / "config.json").write_text(json.dumps(cfg))


def _rewrite(directory: pathlib.Path, change) -> None:
    """Rewrite model.safetensors with `change(dict of float32 arrays)` applied."""
    with SafetensorsFile(directory / "model.safetensors") as f:
        tensors = {n: f.float32(n).copy() for n in f.names()}
    change(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def test_the_loader_yields_exactly_the_weight_keys_of_the_graph(ckpt):
    with Checkpoint.open(ckpt, 256) as c:
        keys = [k for k, _ in c.weights()]
        assert keys == weight_names(c.cfg)


def test_served_context_is_capped_by_the_worker(ckpt):
    with Checkpoint.open(ckpt, 64) as c:
        assert c.cfg.max_context == 64
    with Checkpoint.open(ckpt, 100000) as c:
        assert c.cfg.max_context == 256, "max_position_embeddings bounds the served context"


def test_a_tensor_whose_shape_disagrees_with_config_is_refused_by_name(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", np.zeros((32, 32), np.float32)))
    with pytest.raises(CheckpointError, match=r"model.safetensors, tensor 'model.layers.1.mlp.up_proj.weight'"):
        Checkpoint.open(ckpt, 256)


def test_a_missing_tensor_is_refused_by_name(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight': tensor is missing"):
        Checkpoint.open(ckpt, 256)


def test_an_integer_tensor_where_floats_belong_is_refused(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", np.zeros(32, np.int32)))
    with pytest.raises(CheckpointError, match="I32"):
        Checkpoint.open(ckpt, 256)


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    d = pathlib.Path(shutil.copytree(GOLDEN / "llama-llama3-sharded", tmp_path / "s"))
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-00004.safetensors: file is missing"):
        Checkpoint.open(d, 256)


def test_a_directory_without_weights_or_config_is_refused(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only safetensors"):
        Checkpoint.open(ckpt, 256)
    with pytest.raises(InvalidArgument, match="config.json is missing"):
        Checkpoint.open(tmp_path, 256)


@pytest.mark.parametrize("changes, error, says", [
    ({"architectures": ["GPT2LMHeadModel"]}, InvalidArgument, "supported: LlamaForCausalLM"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, InvalidArgument, "'awq'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": False}}, InvalidArgument,
     "sym False"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 8, "sym": True}}, InvalidArgument,
     "bits 8"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": True}},
     FailedPrecondition, "desc_act True"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True, "group_size": 48}},
     FailedPrecondition, "group_size 48"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     FailedPrecondition, "'yarn'"),
    ({"hidden_act": "gelu"}, InvalidArgument, "SiLU"),
    ({"hidden_size": "wide"}, InvalidArgument, "not a number"),
    ({"head_dim": 16}, FailedPrecondition, "head_dim"),
])
def test_unsupported_configs_are_refused_saying_what_is_supported(ckpt, changes, error, says):
    _edit_config(ckpt, **changes)
    with pytest.raises(error, match=says):
        Checkpoint.open(ckpt, 256)


def test_mistral_with_a_window_shorter_than_the_served_context_is_refused(ckpt):
    _edit_config(ckpt, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    with pytest.raises(FailedPrecondition, match="sliding_window 128"):
        Checkpoint.open(ckpt, 256)
    with Checkpoint.open(ckpt, 128) as c:   # served context within the window: fine
        assert c.spec.architecture == "MistralForCausalLM"


def test_eos_comes_from_generation_config_and_may_be_a_list(ckpt):
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    with Checkpoint.open(ckpt, 256) as c:
        assert c.spec.eos_token_ids == (2, 7)


def test_quantization_streams_in_row_chunks_with_the_same_result(ckpt, monkeypatch):
    import gpu_worker.checkpoints.loader as L
    with Checkpoint.open(ckpt, 256) as c:
        whole = c.host_weights()
    monkeypatch.setattr(L, "CHUNK_ROWS", 5)   # several chunks, the last one partial
    with Checkpoint.open(ckpt, 256) as c:
        chunked = c.host_weights()
    for k in whole:
        np.testing.assert_array_equal(whole[k], chunked[k], err_msg=k)


@pytest.fixture
def bert(tmp_path):
    return pathlib.Path(shutil.copytree(GOLDEN / "bert-st", tmp_path / "bert"))


def test_bert_task_model_prefix_and_gamma_beta_names_load_the_same_weights(bert):
    with Checkpoint.open(bert, 256) as c:
        want = c.host_weights()
    def rename(t):
        for name in list(t):
            new = "bert." + name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta")
            t[new] = t.pop(name)
    _rewrite(bert, rename)
    with Checkpoint.open(bert, 256) as c:
        got = c.host_weights()
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_bert_pooling_other_than_mean_is_refused(bert):
    (bert / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    with pytest.raises(FailedPrecondition, match="only mean pooling"):
        Checkpoint.open(bert, 256)


def test_bert_relative_positions_are_refused(bert):
    _edit_config(bert, position_embedding_type="relative_key")
    with pytest.raises(FailedPrecondition, match="absolute"):
        Checkpoint.open(bert, 256)


def test_without_modules_json_a_bert_is_mean_pooled_and_not_normalized(bert):
    (bert / "modules.json").unlink()
    with Checkpoint.open(bert, 256) as c:
        assert not c.spec.normalize and c.cfg.family == "encoder"


@pytest.fixture
def gptq_ckpt(tmp_path):
    return pathlib.Path(shutil.copytree(GOLDEN / "llama-gptq", tmp_path / "gptq"))


def _rewrite_raw(directory: pathlib.Path, change) -> None:
    with SafetensorsFile(directory / "model.safetensors") as f:
        tensors = {n: np.array(f.tensor(n)) for n in f.names()}
    change(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def test_gptq_act_order_g_idx_is_refused(gptq_ckpt):
    name = "model.layers.0.mlp.down_proj.g_idx"   # in 256: two groups of 128
    _rewrite_raw(gptq_ckpt, lambda t: t.__setitem__(name, t[name][::-1].copy()))
    with pytest.raises(FailedPrecondition, match="act-order"):
        Checkpoint.open(gptq_ckpt, 256)


def test_gptq_asymmetric_zero_points_are_refused(gptq_ckpt):
    name = "model.layers.0.self_attn.k_proj.qzeros"
    _rewrite_raw(gptq_ckpt, lambda t: t.__setitem__(name, t[name] + 1))
    with pytest.raises(CheckpointError, match="zero points other than 8"):
        Checkpoint.open(gptq_ckpt, 256)


def test_gptq_v2_zeros_are_read_as_the_true_zero(gptq_ckpt):
    _edit_config(gptq_ckpt, quantization_config={"quant_method": "gptq", "bits": 4, "sym": True,
                                                  "group_size": 128, "checkpoint_format": "gptq_v2"})
    with pytest.raises(CheckpointError, match="zero points other than 8"):   # v1 file read as v2
        Checkpoint.open(gptq_ckpt, 256)


def test_gptq_scales_of_the_wrong_dtype_are_refused_by_name(gptq_ckpt):
    name = "model.layers.0.self_attn.o_proj.scales"
    _rewrite_raw(gptq_ckpt, lambda t: t.__setitem__(name, t[name].astype(np.float32)))
    with pytest.raises(CheckpointError, match=r"o_proj.scales'.*fp16 scales"):
        Checkpoint.open(gptq_ckpt, 256)


def test_an_index_that_does_not_list_a_tensor_is_refused(tmp_path):
    d = pathlib.Path(shutil.copytree(GOLDEN / "llama-llama3-sharded", tmp_path / "s"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.down_proj.weight' is not in the weight_map"):
        Checkpoint.open(d, 256)
