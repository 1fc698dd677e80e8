"""gpuplane services: shared plumbing (`common`) and the memory governor (`governor`)."""
