"""The batching engines, side by side: the decoder scheduler (continuous batching over paged KV) and
the encoder batcher (embedding requests merged into padded batches)."""
