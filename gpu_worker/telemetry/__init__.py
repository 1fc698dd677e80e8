"""Process-wide observability helpers every layer may use: survived-error counters and domain spans."""
