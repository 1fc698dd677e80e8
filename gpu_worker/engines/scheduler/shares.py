"""How a step's prefill budget is shared among prompts: the pure policy functions of
`--prefill-order` (docs/scheduler.md, "Prefill and decode share the step"). No state, no device:
the scheduler hands them each candidate's demand (at most one chunk) and remaining prompt
tokens, and gets back the tokens each prefills this step."""
from __future__ import annotations


def prefill_shares(demands: list[int], budget: int, floor: int) -> list[int]:
    """Tokens for each prefilling sequence this step, in FCFS order: max-min fair shares of
    `budget` (water-filling: no one gets more than it needs, the rest split evenly), served to
    the FCFS prefix whose floors (min(need, floor)) fit, the others 0. The floor keeps a step
    from splitting into many tiny chunks (each chunk is one graph replay over every weight)."""
    grants = [0] * len(demands)
    n, need = 0, 0
    for d in demands:
        f = min(d, floor)
        if n and need + f > budget:
            break
        need += f
        n += 1
    order = sorted(range(n), key=lambda i: demands[i])
    left = budget
    for k, i in enumerate(order):
        share = left // (n - k)
        grants[i] = min(demands[i], share)
        left -= grants[i]
    for i in range(n):               # what integer division left over, FCFS, up to the need
        if left <= 0:
            break
        extra = min(left, demands[i] - grants[i])
        grants[i] += extra
        left -= extra
    return grants


def shortest_first_shares(demands: list[int], remaining: list[int], budget: int, floor: int,
                          oldest: int) -> list[int]:
    """Tokens for each prefilling sequence this step under `prefill_order="shortest"`, in
    candidate order. First the `oldest` candidate (the earliest submitted) gets min(demand, floor,
    budget); then, by ascending `remaining` prompt tokens (ties in candidate order), each other
    candidate gets its whole demand if it fits in what is left, else nothing, and the oldest, at
    its place in that order and again at the end, whatever is left up to its demand.

    Why whole demands: each chunk is a forward pass over every weight, and at 8b-int4 on the H200
    a pass costs ~9 ms beyond its tokens (docs/scheduler.md, "Mixed traffic"), so a prompt split
    to fill a step's last tokens pays that twice and finishes no earlier (its rest runs the next
    step either way). Only the oldest may be split: its chunk runs anyway, so more of its tokens
    cost no extra pass. Shortest first finishes short prompts in the fewest steps, where fair
    shares finish prompts that arrived together at about the same late step. The oldest's floor
    is the starvation bound: once a prompt is the oldest still prefilling it advances by at least
    min(need, floor, budget) tokens every step, however many shorter prompts keep arriving.
    The scheduler admits the waiting candidates given tokens in queue order and leaves those
    given none queued in place: strict FCFS admission would make the shortest of prompts that
    arrive together wait for every one ahead of it, the very case this order is for."""
    grants = [0] * len(demands)
    if not demands:
        return grants
    grants[oldest] = min(demands[oldest], floor, budget)
    left = budget - grants[oldest]
    for i in sorted(range(len(demands)), key=lambda i: remaining[i]):
        if i == oldest:
            extra = min(demands[i] - grants[i], left)
        elif demands[i] <= left:
            extra = demands[i]
        else:
            continue
        grants[i] += extra
        left -= extra
    grants[oldest] += min(demands[oldest] - grants[oldest], left)
    return grants
