"""Whole-stack tools: the three services as subprocesses (`processes`), the `make run` / `make serve`
driver (`demo`) and its progress lines."""
