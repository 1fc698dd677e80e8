"""gpuplane benchmarks: each prints figures measured side by side in one run. See bench/__main__.py."""
