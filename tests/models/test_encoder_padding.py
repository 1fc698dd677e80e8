"""The encoder's padding mask on the sim backend (real NVRTC modules, NumPy launch bodies):
sequences of different lengths run as one padded batch and each gets exactly what it gets alone."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels.linear import int4_path
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.encoder import (
    ENCODER_MIN_SEQ,
    EncoderModel,
    batch_bucket,
    build_encoder_graph,
    padded_shape,
)
from services.common.errors import InvalidArgument

CFG = CONFIGS["tiny-encoder"]
ATOL = 2e-5


def _ragged(lengths: list[int], salt: int = 0) -> list[list[int]]:
    return [[(b * 131 + t * 17 + salt) % CFG.vocab_size for t in range(n)]
            for b, n in enumerate(lengths)]


@pytest.fixture
def model(device, compiler):
    ex = ModelExecutor(device, compiler)
    m = EncoderModel(ex, CFG, 3, bucketed=True)
    m.load()
    yield m
    ex.close()


def test_a_padded_batch_gives_each_sequence_its_solo_embedding(model) -> None:
    sequences = _ragged([1, 5, 33, 7, 64, 2])
    batched = model.embed(sequences)
    assert model.executor.plans.keys() == [("encode", 8, 64)], "one padded plan for the batch"
    solo = np.stack([model.embed([s])[0] for s in sequences])
    np.testing.assert_allclose(batched, solo, rtol=0, atol=ATOL,
                               err_msg="padding changed a real row's embedding")
    want = R.EncoderReference(CFG, W.load_host(CFG, 3)).embed(sequences, rows=8 * 64)
    np.testing.assert_allclose(batched, want, rtol=1e-3, atol=5e-4,  # fp16 rounding flips
                               err_msg="padded batch differs from the NumPy reference")


def test_padding_values_do_not_reach_real_rows(model) -> None:
    """The same real rows with different garbage in the padded positions and padded batch rows:
    bit-identical results (the mask, not luck, keeps padding out)."""
    short = _ragged([3, 9])
    a = model.embed(short)
    b = model.embed(short + _ragged([40, 20, 11], salt=9))[:2]   # plan (8, 64), not (2, 32)
    np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    # the same plan, different tokens in a neighbour row: bit-identical real rows
    c = model.embed(_ragged([3, 9]) + [[5] * 30])[:2]
    d = model.embed(_ragged([3, 9]) + [[700] * 30])[:2]
    assert np.array_equal(c, d), "the padding mask let other rows' tokens into a real row"


def test_shapes_sit_on_the_ladder_so_plans_stay_few() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert padded_shape([1], 1024) == (4, ENCODER_MIN_SEQ)   # at least ENCODER_MIN_ROWS rows
    assert padded_shape([100, 3, 3], 1024) == (4, 128)
    assert padded_shape([1000], 1024) == (1, 1024)
    assert padded_shape([100, 3, 3], 1024, bucketed=False) == (3, 100)
    shapes = {padded_shape([n] * b, CFG.max_context) for b in range(1, 65) for n in range(1, 1025)}
    assert len(shapes) == 5 + 6 + 7 * 4, "64 batch sizes x 1024 lengths land on 39 plan shapes"


def test_every_bucketed_shape_runs_its_linears_on_one_path() -> None:
    """Padding changes no real row only if a lone request and the batch it could join round
    alike: no bucketed plan may fall under the int4 linear's fused crossover (64 rows)."""
    paths = {int4_path(int(np.prod(padded_shape([n] * batch, CFG.max_context))))
             for batch in range(1, 65) for n in (1, 31, 33, 64, 65, 1024)}
    assert paths == {"tensor"}


def test_graph_masks_attention_and_pooling_with_the_lengths_input() -> None:
    g = build_encoder_graph(CFG, 2, 32)
    assert g.tensors["lengths"].shape == (2,) and g.tensors["lengths"].dtype == "i32"
    readers = {n.op for n in g.nodes if "lengths" in n.inputs}
    assert readers == {"attention_bidirectional", "mean_pool"}


def test_an_empty_or_overlong_sequence_is_refused_whatever_its_neighbours(model) -> None:
    with pytest.raises(InvalidArgument, match="sequence 1 is empty"):
        model.check([[1, 2], []])
    with pytest.raises(InvalidArgument, match="exceed the context"):
        model.check([[1], [1] * (CFG.max_context + 1)])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        model.check([[1], [CFG.vocab_size]])
