"""bench/decode_bench.py times the paged path the server runs, not only the single-sequence
DecoderModel: on the sim, its window of decode tokens gives the DecoderModel's greedy tokens."""
from __future__ import annotations

import argparse
import math

from bench import decode_bench


def test_the_paged_server_path_decodes_the_same_tokens_as_the_decoder_model_every_trial():
    args = argparse.Namespace(backend="sim", config="tiny", prompt=12, warmup=2, steps=4,
                              trials=2)
    mine = decode_bench.ours(args)
    server = decode_bench.paged(args)
    assert server["same_tokens"], "every paged trial must give the same greedy tokens"
    assert server["tokens"] == mine["tokens"], "the paged path decodes what DecoderModel decodes"
    assert len(server["rates"]) == 2 and all(r > 0 and math.isfinite(r) for r in server["rates"])
