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
- Each layer is a segment of its own (a layer is one weight slot, one copy). Some segments are
  *kept*: paged in once and left resident; the others *stream*, each demoted to the slots' next
  victim as soon as its launches are enqueued. At a run's worst moment the device holds S (the
  shared bytes), every kept segment and two streamed ones (the one running and the next, which
  is paging in), so segments are kept largest first while that sum fits B, the budget. A run
  then pages (weights - S - kept): the minimum (weights - B) plus about one streamed pair. The
  streamed layers are left one contiguous run. Before, layers were packed into segments up to
  (B - S) / 2: two in flight filled the budget, nothing stayed, and every run paged every
  weight (2.0x the minimum at half the weights, 4.4x at 0.8; 8b-int4 on the H200 at a third:
  1.08x now). A graph whose neighbouring pair does not fit even one layer per segment is
  refused (ResourceExhausted naming the bytes). Costs are committed granule bytes, not tensor
  bytes.
- Run: before a segment launches its slots are pinned and resident (the compute stream waits on
  their copy events). The first streamed segment's page-in is issued when the run starts; each
  streamed segment issues the next streamed one's (kept segments in between skipped) before it
  launches, after the streamed one before it finished, so the copies queue back to back on the
  copy stream and the host never runs more than one streamed segment ahead. A segment is
  unpinned once its launches are enqueued. Eviction is fenced on both streams, so nothing unmaps
  a slot a launch in flight reads; the live ledger holds at most S, the kept segments and two
  streamed ones (the device one more streamed segment until its fenced release passes). A kept
  segment that a reclaim paged out meanwhile pages in again at its turn.
- Captured: each segment is its own graph, captured the first time it runs (it is resident then,
  so a BLAS warm-up may run eagerly first) and replayed in order between the residency steps.
  Eager: the same segments, node by node.
Cost: per segment and run, a pin, an ensure_resident (a dict lookup per resident slot) and one
graph launch, and per streamed segment one host wait on the streamed segment before it; the bytes paged per run are the streamed
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


def _streamed_pairs(segments: Sequence[Segment]) -> list[tuple[Segment, ...]]:
    """Each two streamed segments that follow each other in the run (kept ones skipped: the one
    running and the one paging in), or the single streamed segment, or none."""
    streamed = [s for s in segments if not s.stays]
    return list(itertools.pairwise(streamed)) or [tuple(streamed)]


def _window(segments: Sequence[Segment], cost: Cost, shared: list[str]) -> int:
    """Committed bytes resident at the worst moment of a run: shared, every kept segment, and
    the largest pair of streamed segments in flight together (`_streamed_pairs`)."""
    kept = [k for s in segments if s.stays for k in s.keys]
    return max(cost([*shared, *kept, *(k for s in pair for k in s.keys)])
               for pair in _streamed_pairs(segments))


def _choose_stays(segments: list[Segment], cost: Cost, shared: list[str], budget: int) -> None:
    """Mark the segments to keep resident: largest first (ties: the earliest), each kept while
    the run's worst moment (`_window`) still fits `budget`. Judged on the segments' own costs
    (additive: fast, and never less than the committed bytes), then checked with `cost` (a
    granule shared by neighbours is paid once) and the smallest kept given up until it fits.
    Largest first keeps the embedding and the head when they fit and leaves the streamed
    layers one contiguous run, whose copies queue back to back."""
    costs = [s.cost for s in segments]
    base = cost(shared) if shared else 0

    def worst() -> int:
        return (base + sum(s.cost for s in segments if s.stays)
                + max(sum(s.cost for s in pair) for pair in _streamed_pairs(segments)))
    for i in sorted(range(len(segments)), key=lambda i: -costs[i]):
        segments[i].stays = True
        if worst() > budget:
            segments[i].stays = False
    kept = sorted((s for s in segments if s.stays), key=lambda s: -s.cost)
    while kept and _window(segments, cost, shared) > budget:
        kept.pop().stays = False


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
        # streamed segments in run order: each one's successor pages in while it runs
        self._streamed = [i for i, s in enumerate(schedule.segments) if not s.stays]
        self._next_streamed = dict(itertools.pairwise(self._streamed))
        self._prev_streamed = {b: a for a, b in self._next_streamed.items()}
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
            prefetched: dict[int, list[str]] = {}
            if self._streamed:     # the first streamed segment pages in from the start
                first = self._streamed[0]
                prefetched[first] = pin(list(self._slots[first]))
                slots.ensure_resident(prefetched[first], stream=stream, wait=False)
            for i, seg in enumerate(segs):
                if i in prefetched:
                    cur = prefetched.pop(i)
                    slots.wait_resident(cur, stream)   # it reads them: wait for the copy
                else:               # a kept segment: a hit, unless a reclaim took it meanwhile
                    cur = pin(list(self._slots[i]))
                    slots.ensure_resident(cur, stream=stream)
                nxt = self._next_streamed.get(i)
                if nxt is not None:
                    prev = self._prev_streamed.get(i)
                    if prev is not None:   # at most one streamed segment ahead: the one before
                        device.wait_event(self._done[prev])   # finished, its pages may go
                    prefetched[nxt] = pin(list(self._slots[nxt]))
                    slots.ensure_resident(prefetched[nxt], stream=stream, wait=False)
                self._launch(seg, inputs, stream, capture)
                device.record_event(self._done[i], stream)
                unpin(cur)       # its launches are enqueued; eviction is fenced on the streams
                if not seg.stays:
                    slots.demote(cur)   # needed again only next run, after every other slot
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
