"""Hugging Face checkpoints on local disk: safetensors over mmap, config.json -> ModelConfig,
HF tensor names -> our weight keys, int4 quantization on load (see loader.py). Every file is
read through `CheckpointFiles`, the model-root sandbox (paths.py)."""
from gpu_worker.checkpoints.hf_config import SUPPORTED, CheckpointSpec, read_spec
from gpu_worker.checkpoints.loader import Checkpoint
from gpu_worker.checkpoints.paths import CheckpointFiles
from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, write_safetensors

__all__ = ["SUPPORTED", "Checkpoint", "CheckpointError", "CheckpointFiles", "CheckpointSpec",
           "SafetensorsFile", "read_spec", "write_safetensors"]
