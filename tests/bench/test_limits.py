"""bench/limits.py without a device: the rotation rule that keeps kernel working sets out of L2."""
from __future__ import annotations

import pytest

from bench.limits import (
    L2_BYTES,
    ROTATE_FACTOR,
    STREAM_READ,
    STREAM_READ_UNROLL,
    SameBytes,
    measure,
    rotation,
)


def test_a_rotation_set_is_at_least_four_l2s_of_distinct_data():
    for nbytes in (1 << 20, 33_554_432, 60 << 20, 200 << 20, 4 << 30):
        sets = rotation(nbytes)
        assert sets >= 2, "a replay must never read the buffer the previous one just read"
        assert sets * nbytes >= ROTATE_FACTOR * L2_BYTES, \
            f"{sets} sets of {nbytes} bytes fit in {ROTATE_FACTOR} L2s: the benchmark measures L2"


def test_the_batch1_8k_decode_cache_is_rotated_not_replayed():
    kv = 2 * 8192 * 8 * 128 * 2          # K and V, fp16, 8 KV heads of 128: 33.5 MB < L2
    assert kv < L2_BYTES and rotation(kv) * kv > 3 * L2_BYTES


def test_without_a_device_no_limit_is_invented(capsys):
    from bench import peer
    if peer.available():
        pytest.skip("a CUDA device is present: the limits are measured")
    assert measure(quiet=False) is None, "no device: no limits, never a default figure"
    assert "not measured" in capsys.readouterr().out


@pytest.mark.parametrize("unroll", STREAM_READ_UNROLL)
def test_the_plain_read_kernel_compiles_with_nvrtc_for_each_unroll(unroll):
    """bench/stream_read.cu is built by CuPy on the GPU machine; NVRTC runs here too."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    _, prog = nvrtc.nvrtcCreateProgram(STREAM_READ.read_text().encode(), b"stream_read.cu", 0,
                                         [], [])
    opts = [f"-DU={unroll}".encode(), b"--gpu-architecture=compute_90"]
    result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
    _, ptx_size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * ptx_size
    nvrtc.nvrtcGetPTX(prog, ptx)
    assert b".entry gp_stream_read" in ptx and b".entry gp_head_read" in ptx
    for entry in (b"gp_stream_read", b"gp_head_read"):
        body = ptx.split(b".entry " + entry)[1].split(b".entry")[0]
        assert body.count(b"ld.global.cs.v4") >= unroll, f"{entry}: streaming loads are its reads"


def test_a_same_bytes_line_names_the_plain_read_where_it_was_measured():
    with_read = SameBytes(67_108_864, 2736.0, 2758.0, 2283.0, 2938.0)
    assert "a plain read 2,938" in with_read.line(3000.0)
    assert "plain read" not in SameBytes(67_108_864, 2736.0, 2758.0, 2283.0).line()


def test_same_bytes_are_recorded_as_figures_and_the_read_only_where_measured(tmp_path):
    import json

    from bench.limits import record_same_bytes
    from bench.record import Recorder
    from bench.targets import Targets
    t = Targets("limits", record=Recorder("limits", tmp_path, device="test-gpu", argv=["x"]))
    record_same_bytes(t, SameBytes(67_108_864, 2736.0, 2758.0, 2283.0, 2938.0))
    record_same_bytes(t, SameBytes(1_073_741_824, 2439.0, 3035.0, 3064.0))
    lines = {x["metric"]: x for x in map(json.loads,
                                          (tmp_path / "test-gpu.jsonl").read_text().splitlines())}
    assert lines["same bytes: copy, 67.1 MB a launch"]["value"] == 2758.0
    assert lines["same bytes: plain read, 67.1 MB a launch"]["value"] == 2938.0
    assert lines["same bytes: copy, 1,073.7 MB a launch"]["value"] == 3035.0
    assert "same bytes: plain read, 1,073.7 MB a launch" not in lines
    assert all(x["target"] is None for x in lines.values()), "figures, not targets"


def test_a_launch_size_under_16_bytes_is_refused_with_how_to_fix(capsys):
    from bench.limits import main
    with pytest.raises(SystemExit):
        main(["--same-bytes", "67108864,8"])
    assert "at least 16" in capsys.readouterr().err
