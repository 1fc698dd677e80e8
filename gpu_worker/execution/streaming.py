"""Streaming execution: a model whose weights exceed the weight budget runs its graphs in segments.

Hazard: a captured graph bakes weight addresses and replays without asking whether they are
mapped. When a model's weights exceed the slots' budget they can never all be resident at once,
so neither one whole-graph replay nor a page-in of every weight before a request can work.
Contract:
- A graph's nodes (those before the `select_row` split) are cut into *segments* of consecutive
  nodes, grouped by the `layers.N.` prefix of the weights they read; a node that reads no weight
  of its own joins the segment it sits in. Non-layer weights read inside the layer span (a rope
  table, tied embeddings) are *shared*: pinned and resident for the whole run. The other non-layer
  runs (embedding, final norm + head) are segments of their own; the eager tail after the split
  is one more segment.
- Each layer is a segment of its own (a layer is one weight slot, one copy). Some segments
  *stay*: chosen largest first while S + stay + the largest pair of neighbouring *streamed*
  segments still fits B (B the budget, S the shared bytes), they are paged in once and kept;
  the rest stream, each demoted to the next victim as soon as its launches are enqueued. A sweep
  then pages (weights - S - stay) per run, within about two layers of the minimum
  (weights - B). Packing layers into segments up to (B - S) / 2, as before, let two in-flight
  segments fill the budget: every run evicted everything and paged every weight (2.0x the
  minimum at half the weights, 4.4x at 0.8). A graph whose neighbouring pair does not fit even
  one layer per segment is refused (ResourceExhausted naming the bytes). Costs are committed
  granule bytes, not tensor bytes.
- Run: before segment i launches its slots are pinned and resident (the compute stream waits on
  their copy events); segment i+1's page-in is issued on the copy stream before segment i's
  launches, so it overlaps them; segment i is unpinned once its launches are enqueued. Eviction
  is fenced on both streams, so nothing unmaps a slot a launch in flight reads. The host never
  runs more than one segment ahead: before paging in i+1 it waits for segment i-1 to finish, so
  the device holds at most the shared weights and three segments (the live ledger: two).
- Captured: each segment is its own graph, captured the first time it runs (it is resident then,
  so a BLAS warm-up may run eagerly first) and replayed in order between the residency steps.
  Eager: the same segments, node by node.
Cost: per segment and run, a pin, an ensure_resident (a dict lookup per resident slot), one host
wait on the segment before last and one graph launch; the bytes paged per run are the streamed
segments' (`Schedule.streamed_bytes`), bounded below by (model weights - budget), every one of
them copied at pinned H2D speed.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted

_LAYER = re.compile(r"^layers\.(\d+)\.")

Cost = Callable[[Iterable[str]], int]   # committed bytes of a set of weight keys


def layer_of(key: str) -> int | None:
    """N for a `layers.N.` weight key; None for a non-layer weight."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


@dataclass(eq=False)
class Segment:
    label: str
    nodes: list
    keys: list[str]                  # graph weight keys its nodes read (shared ones excluded)
    cost: int                        # committed bytes of `keys`
    tail: bool = False               # the eager tail after `select_row`
    stays: bool = False              # kept resident across runs (not demoted after it runs)
    graph_exec: object | None = field(default=None, repr=False)
    graph_bytes: int = 0


@dataclass
class Schedule:
    segments: list[Segment]
    shared: list[str]
    shared_cost: int
    budget: int

    def peak_bytes(self, cost: Cost) -> int:
        """The most committed weight bytes the run needs pinned at once (two neighbours + shared)."""
        segs = self.segments
        if len(segs) == 1:
            return cost([*self.shared, *segs[0].keys])
        return max(cost([*self.shared, *a.keys, *b.keys]) for a, b in itertools.pairwise(segs))

    def streamed_bytes(self, cost: Cost) -> int:
        """Committed bytes of the segments that page in on every run (those that do not stay)."""
        return cost([k for s in self.segments if not s.stays for k in s.keys])


def _window(segments: Sequence[Segment], cost: Cost, shared: list[str]) -> int:
    """Committed bytes resident at the worst moment of a run: shared, every staying segment, and
    the largest pair of neighbours' streamed keys (the running segment and the one paging in)."""
    stay = [k for s in segments if s.stays for k in s.keys]
    pairs = list(itertools.pairwise(segments)) or [(segments[0], segments[0])]
    return max(cost([*shared, *stay, *(a.keys if not a.stays else ()),
                     *(b.keys if not b.stays else ())]) for a, b in pairs)


def _cover(costs: Sequence[int], window: int) -> list[int] | None:
    """The cheapest set of segments to keep so that every streamed segment, and every pair of
    neighbouring streamed ones, is at most `window` bytes (dynamic programming along the run);
    None if no set does."""
    inf = float("inf")
    # best[i][k]: least kept bytes of segments 0..i with segment i kept (k=1) or streamed (k=0);
    # prev[i][k]: the choice for segment i-1 that achieves it
    best = [[0.0 if costs[0] <= window else inf, float(costs[0])]]
    prev = [[0, 0]]
    for i in range(1, len(costs)):
        keep_prev = 0 if best[-1][0] <= best[-1][1] else 1
        options = [(best[-1][1], 1)]
        if costs[i - 1] + costs[i] <= window:
            options.append((best[-1][0], 0))
        stream_cost, stream_prev = min(options) if costs[i] <= window else (inf, 0)
        best.append([stream_cost, costs[i] + best[-1][keep_prev]])
        prev.append([stream_prev, keep_prev])
    k = 0 if best[-1][0] <= best[-1][1] else 1
    if best[-1][k] == inf:
        return None
    chosen = []
    for i in range(len(costs) - 1, -1, -1):
        if k:
            chosen.append(i)
        k = prev[i][k]
    return chosen


def _choose_stays(segments: list[Segment], cost: Cost, shared: list[str], budget: int) -> None:
    """Mark the segments to keep resident. A run's worst moment holds S, the kept segments and
    the largest streamed pair of neighbours (`_window`), so keeping more is only worth it while
    that pair stays small: for each candidate pair size w, keep the cheapest set that bounds
    every streamed pair by w (`_cover`), fill what the budget leaves with the largest remaining
    segments, and take the w that keeps the most bytes. Committed costs are checked exactly at
    the end (a granule shared by neighbours makes them less than additive)."""
    costs = [s.cost for s in segments]
    s_cost = cost(shared) if shared else 0
    best: tuple[int, set[int], set[int]] = (-1, set(), set())
    for w in sorted({*costs, *(a + b for a, b in itertools.pairwise(costs))}):
        if s_cost + w > budget:
            break
        forced = _cover(costs, w)
        if forced is None:
            continue
        room = budget - s_cost - w - sum(costs[i] for i in forced)
        if room < 0:
            continue
        kept = set(forced)
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            if i not in kept and costs[i] <= room:
                kept.add(i)
                room -= costs[i]
        total = sum(costs[i] for i in kept)
        if total > best[0]:
            best = (total, kept, set(forced))
    _, kept, forced = best
    for i in kept:
        segments[i].stays = True
    fill = sorted(kept - forced, key=lambda i: -costs[i])
    while _window(segments, cost, shared) > budget:
        if not fill:     # the cover alone is over: keep nothing (the plain pairs fit)
            for seg in segments:
                seg.stays = False
            return
        segments[fill.pop()].stays = False


def _shared_keys(nodes: Sequence) -> set[str]:
    """Non-layer weights read somewhere inside the layers' span: pinned for the whole run."""
    layer_nodes = [i for i, nd in enumerate(nodes)
                   if any(layer_of(w) is not None for w in nd.weights)]
    if not layer_nodes:
        return set()
    first, last = layer_nodes[0], layer_nodes[-1]
    readers: dict[str, list[int]] = {}
    for i, nd in enumerate(nodes):
        for w in nd.weights:
            if layer_of(w) is None:
                readers.setdefault(w, []).append(i)
    return {w for w, idx in readers.items() if min(idx) <= last and max(idx) >= first}


def _units(nodes: Sequence, shared: set[str]) -> list[tuple[object, list]]:
    """Maximal runs of nodes with one tag: ("layer", N...) or "other"; untagged nodes join the
    run they sit in (leading ones the first run)."""
    units: list[tuple[object, list]] = []
    leading: list = []
    for nd in nodes:
        layers = tuple(sorted({n for w in nd.weights if (n := layer_of(w)) is not None}))
        own = [w for w in nd.weights if layer_of(w) is None and w not in shared]
        tag = ("layer", *layers) if layers else ("other" if own else None)
        if tag is None or (units and units[-1][0] == tag):
            (units[-1][1] if units else leading).append(nd)
            continue
        units.append((tag, leading + [nd]))
        leading = []
    if leading:
        if units:
            units[-1][1].extend(leading)
        else:
            units.append(("other", leading))
    return units


def _keys(nodes: Iterable, shared: set[str]) -> list[str]:
    return list(dict.fromkeys(w for nd in nodes for w in nd.weights if w not in shared))


def _label(unit_tags: list[object], keys: list[str]) -> str:
    layers = sorted({n for t in unit_tags if t != "other" for n in t[1:]})
    if layers:
        return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return ",".join(sorted({k.split(".")[0] for k in keys})) or "no weights"


def plan_schedule(nodes: Sequence, split: int, cost: Cost, budget: int,
                  what: str = "model", source: str = "--weight-budget-bytes") -> Schedule:
    """Cut `nodes` (the first `split` captured, the rest the eager tail) into one segment per
    layer (and per non-layer run), choose the ones that stay resident, and check that every
    neighbouring pair fits `budget` with the shared weights; ResourceExhausted if one does not."""
    shared = _shared_keys(nodes)
    shared_list = sorted(shared)
    s_cost = cost(shared_list) if shared_list else 0
    tail_nodes = list(nodes[split:])
    segments: list[Segment] = []
    for tag, unit in _units(nodes[:split], shared):
        keys = _keys(unit, shared)
        segments.append(Segment(_label([tag], keys), list(unit), keys, cost(keys)))
    if tail_nodes:
        keys = _keys(tail_nodes, shared)
        segments.append(Segment("tail:" + _label(["other"], keys), tail_nodes, keys, cost(keys),
                                tail=True))
    schedule = Schedule(segments, shared_list, s_cost, budget)
    need = schedule.peak_bytes(cost)
    if need > budget:
        raise ResourceExhausted(
            f"weights: {what} cannot stream through a {budget}-byte weight budget: its segments "
            f"need {need} committed bytes resident at once (two neighbouring segments, one layer "
            f"each at the least, plus {s_cost} bytes of shared weights); raise {source} to at "
            "least that", asked_bytes=need, free_bytes=budget,
            zone="weights")
    _choose_stays(segments, cost, shared_list, budget)
    return schedule


def streaming_floor(keys_in_order: Sequence[str], cost: Cost) -> int:
    """The smallest budget a model of these weight keys (load order) can stream through, judged
    by keys alone (no graph yet): one layer per segment, each non-layer run its own segment, the
    largest committed bytes of two neighbours. The graph's schedule may add shared weights."""
    units: list[tuple[object, list[str]]] = []
    for k in keys_in_order:
        n = layer_of(k)
        tag = ("layer", n) if n is not None else "other"
        if units and units[-1][0] == tag:
            units[-1][1].append(k)
        else:
            units.append((tag, [k]))
    if len(units) == 1:
        return cost(units[0][1])
    return max(cost(a + b) for (_, a), (_, b) in itertools.pairwise(units))


def refuse_unstreamable(what: str, floor: int, budget: int,
                        source: str = "--weight-budget-bytes") -> None:
    """ResourceExhausted naming the floor, the budget and where the budget comes from."""
    if floor > budget:
        raise ResourceExhausted(
            f"weights: {what} needs at least {floor} committed bytes of weight budget to stream "
            f"its layers through the slots (two neighbouring segments, one layer each), more "
            f"than the {budget}-byte weight budget ({source})",
            asked_bytes=floor, free_bytes=budget, zone="weights")


def granule_cost(spans: Iterable[tuple[int, int]], base: int, granule: int) -> int:
    """Committed bytes of the union of the granules that the (va, nbytes) spans touch."""
    granules: set[int] = set()
    for va, nbytes in spans:
        granules.update(range((va - base) // granule, (va + nbytes - 1 - base) // granule + 1))
    return len(granules) * granule


def packed_cost(sizes: Iterable[int], granule: int, align: int) -> int:
    """Committed bytes of weights of these sizes packed in one carve run (no addresses yet):
    aligned content rounded up to granules, plus one granule for a straddled boundary."""
    content = sum(-(-n // align) * align for n in sizes)
    return -(-content // granule) * granule + granule


class StreamedRun:
    """Runs one ShapePlan's graph as the segments of its Schedule through the weight slots."""

    def __init__(self, plan, schedule: Schedule) -> None:
        self.plan, self.schedule = plan, schedule
        device = plan.executor.device
        self._done = [device.create_event() for _ in schedule.segments]
        # The slots each segment pins and pages in (one per layer, not one per tensor), resolved
        # once: the host work of a run is per slot.
        self._shared = plan.executor.slot_keys(schedule.shared)
        self._slots = [plan.executor.slot_keys(s.keys) for s in schedule.segments]
        self.runs = 0

    @property
    def graph_bytes(self) -> int:
        return sum(s.graph_bytes for s in self.schedule.segments)

    def run(self, inputs: dict, stream: object, capture: bool) -> None:
        device = self.plan.executor.device
        slots = device.weights
        segs = self.schedule.segments
        pinned: list[list[str]] = []

        def pin(keys: list[str]) -> list[str]:
            slots.pin(keys)
            pinned.append(keys)
            return keys

        def unpin(keys: list[str]) -> None:
            pinned.remove(keys)
            slots.unpin(keys)
        try:
            shared = pin(list(self._shared))
            slots.ensure_resident(shared, stream=stream)
            cur = pin(list(self._slots[0]))
            slots.ensure_resident(cur, stream=stream)
            for i, seg in enumerate(segs):
                nxt = None
                if i + 1 < len(segs):
                    if i >= 1:   # at most one segment ahead: i-1 finished, its pages may go
                        device.wait_event(self._done[i - 1])   # and runs passed releases
                    nxt = pin(list(self._slots[i + 1]))
                    slots.ensure_resident(nxt, stream=stream, wait=False)   # overlaps segment i
                self._launch(seg, inputs, stream, capture)
                device.record_event(self._done[i], stream)
                unpin(cur)       # its launches are enqueued; eviction is fenced on the streams
                if not seg.stays:
                    slots.demote(cur)   # needed again only next run, after every other slot
                if nxt is not None:
                    slots.wait_resident(nxt, stream)   # segment i+1 reads them: wait the copy
                    cur = nxt
            self.runs += 1
        finally:
            for keys in reversed(pinned):
                slots.unpin(keys)

    def _launch(self, seg: Segment, inputs: dict, stream: object, capture: bool) -> None:
        plan = self.plan
        if seg.tail:
            plan._run_tail(inputs, stream)
            return
        if not capture:
            plan._launch_warm(plan.resolve(seg.nodes), stream)
            return
        if seg.graph_exec is None:
            warmed = False

            def capture_segment() -> None:
                nonlocal warmed   # a retried capture finds the shapes warm: keep the first's
                seg.graph_exec, seg.graph_bytes, ran = plan.capture_steps(
                    plan.resolve(seg.nodes), stream)
                warmed = warmed or ran
            plan.executor.device.arena.retry_reclaiming("graphs", capture_segment)
            # A segment runs exactly once per run, unlike a whole graph: its inputs are
            # activations of earlier segments, and the plan layout lets a later node of the same
            # segment reuse their bytes once they are read, so a second launch reads clobbered
            # inputs. The BLAS warm-up already ran it eagerly: no replay this time.
            if warmed:
                return
        plan.executor.device.replay(seg.graph_exec, stream=stream)
        plan.executor.replay_count += 1

    def captured(self) -> int:
        """How many segments hold a graph exec."""
        return sum(s.graph_exec is not None for s in self.schedule.segments)

    def reset_graphs(self) -> None:
        """Destroy every segment's graph exec (the caller synchronized the stream)."""
        device = self.plan.executor.device
        for seg in self.schedule.segments:
            if seg.graph_exec is not None:
                device.destroy_graph_exec(seg.graph_exec)
                seg.graph_exec, seg.graph_bytes = None, 0

    def close(self) -> None:
        self.reset_graphs()
        device = self.plan.executor.device
        for ev in self._done:
            device.destroy_event(ev)
        self._done = []
