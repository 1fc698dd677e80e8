"""The pipelined load (loader.weights()): same weights whatever the threads, chunks and lookahead;
bounded lookahead; no conversion thread outlives the load or the mapping."""
from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

import gpu_worker.checkpoints.loader as L
from gpu_worker.checkpoints import Checkpoint
from gpu_worker.checkpoints.quantize import HostQuantizer
from gpu_worker.checkpoints.shards import ShardSet
from gpu_worker.models.weights import _FUSABLE, Fusion, fuse_linears, quantize

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("checkpoint-load")]


def test_every_linear_is_exactly_the_reference_quantizer_on_the_stored_floats():
    with Checkpoint.open(GOLDEN / "llama-llama3-sharded", 256) as c:
        got = c.host_weights()
    shards = ShardSet(GOLDEN / "llama-llama3-sharded")
    try:
        for name, key in [("model.layers.0.mlp.down_proj.weight", "layers.0.w_down"),
                          ("model.layers.1.self_attn.k_proj.weight", "layers.1.wk"),
                          ("lm_head.weight", "lm_head")]:
            want = quantize(shards.float32(name))
            np.testing.assert_array_equal(got[key + ".q"], want.packed, err_msg=key)
            np.testing.assert_array_equal(got[key + ".s"], want.scales, err_msg=key)
    finally:
        shards.close()


@pytest.mark.parametrize("threads,rows,lookahead", [(1, 1024, 0), (4, 3, 0), (3, 5, 8)])
def test_threads_chunks_and_lookahead_do_not_change_the_weights(monkeypatch, threads, rows,
                                                                 lookahead):
    with Checkpoint.open(GOLDEN / "qwen2-untied", 256) as c:
        want = c.host_weights()
    monkeypatch.setattr(L, "QUANT_THREADS", threads)
    monkeypatch.setattr(L, "CHUNK_ROWS", rows)
    monkeypatch.setattr(L, "MAX_LOOKAHEAD", lookahead)
    with Checkpoint.open(GOLDEN / "qwen2-untied", 256) as c:
        got = c.host_weights()
    assert list(got) == list(want)   # weight_names order, too
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_lookahead_is_bounded_so_the_model_is_never_all_in_host_memory(monkeypatch):
    monkeypatch.setattr(L, "QUEUED_PER_THREAD", 1000)   # only MAX_LOOKAHEAD limits it
    monkeypatch.setattr(L, "MAX_LOOKAHEAD", 2)
    built, finished = [0], [0]
    real_jobs = L.Checkpoint._jobs

    def counting(self):
        for job in real_jobs(self):
            built[0] += 1   # its output arrays are allocated now
            real_finish = job.finish

            def finish(real_finish=real_finish):
                finished[0] += 1   # handed to the consumer
                return real_finish()
            job.finish = finish
            yield job
    monkeypatch.setattr(L.Checkpoint, "_jobs", counting)
    ahead = []
    with Checkpoint.open(GOLDEN / "llama-tied", 256) as c:
        for _ in c.weights():
            ahead.append(built[0] - finished[0])
    assert built[0] > 10
    assert max(ahead) == 2, ahead   # beyond the tensor being taken: the lookahead, never more


def test_closing_a_checkpoint_mid_load_stops_every_conversion_thread(monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ROWS", 2)   # many queued chunks
    c = Checkpoint.open(GOLDEN / "llama-llama3-sharded", 256)
    stream = c.weights()
    next(stream)   # the consumer took one tensor and failed (say): the pool is still converting
    assert _load_threads()
    c.close()      # before the generator is finalized, as when a traceback keeps it alive
    assert not _load_threads()
    stream.close()   # finalizing it afterwards is harmless


class _Failing(HostQuantizer):
    def __call__(self, raw, dtype, packed, scales):
        raise RuntimeError("chunk failed")


def test_a_failing_chunk_fails_the_load_and_leaves_no_thread_running():
    with Checkpoint.open(GOLDEN / "llama-tied", 256, quantizer=_Failing()) as c, \
            pytest.raises(RuntimeError, match="chunk failed"):
        c.host_weights()
    assert not _load_threads()


def test_the_profile_counts_every_staged_byte_and_some_time():
    with Checkpoint.open(GOLDEN / "llama-tied", 256) as c:
        weights = c.host_weights()
        p = c.profile
    cfg = c.cfg
    # staged: the embedding table and every linear (the tied head reads the table again), bf16
    linears = sum(o * i for o, i in cfg.linear_shapes().values()) * cfg.layers
    assert p.bytes_read == 2 * (linears + 2 * cfg.vocab_size * cfg.hidden)
    assert p.read_s > 0 and p.convert_s > 0 and p.wait_s >= 0
    assert "lm_head.q" in weights


@pytest.mark.parametrize("golden,fmt", [("llama-llama3-sharded", "int4"), ("qwen2-untied", "int4"),
                                        ("qwen2-untied", "fp16"), ("bert-st", "int4"),
                                        ("llama-gptq", "int4")])
def test_a_fused_load_converts_the_parts_in_place_to_fuse_linears_bytes(monkeypatch, golden, fmt):
    """weights(fuse=True) is fuse_linears(weights()) (qwen2: the q/k/v biases too), with each
    converted part written into its rows of the fused tensor: Fusion copies only what the loader
    did not convert itself (the biases; a GPTQ file's linears, already 4-bit), never a linear it
    quantized or cast."""
    with Checkpoint.open(GOLDEN / golden, 256, weight_format=fmt) as c:
        want = list(fuse_linears(c.cfg, c.weights()))
    copied: list[str] = []
    real = Fusion.done

    def done(self, key, host):
        if _FUSABLE.match(key) and host is not self._views.get(key):   # not converted in place
            copied.append(key)
        return real(self, key, host)
    monkeypatch.setattr(Fusion, "done", done)
    with Checkpoint.open(GOLDEN / golden, 256, weight_format=fmt) as c:
        got = list(c.weights(fuse=True))
    assert [k for k, _ in got] == [k for k, _ in want]
    for (key, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b, err_msg=key)
    gptq = c.spec.gptq_group
    assert all(k.endswith(".b") or gptq for k in copied), copied
