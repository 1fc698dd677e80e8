"""Plumbing every gpuplane server shares: bootstrap, health, reflection, errors, telemetry, config."""
