"""Scenarios shared by the sim tests and their GPU twins (same steps, the backend differs)."""
from __future__ import annotations

from gpu_worker.core.admission import admission_bytes
from gpu_worker.core.runtime import WorkerRuntime
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import get_config
from services.common.errors import ResourceExhausted

PROMPT = [5, 6, 7, 8, 9, 10]


def swapped_and_plain_runs(device, compiler, cfg, seed: int, new_tokens: int
                           ) -> tuple[dict[str, list[list[int]]], dict]:
    """Three streams of a paged decoder run twice: as they are ("plain"), and with the newest
    sequence preempted at steps 2 (its prefill done, its first token not read back: a one-token
    prefill resumes it), 5 and 9 (decoding: resumed at their decode), its KV swapped to pinned
    host and back ("swapped"). Returns each run's tokens and the swapped run's scheduler stats;
    asserts every host byte came back."""
    from gpu_worker.engines.scheduler.kv_swap import HostKVBudget, KVSwap, measure_copy_rates
    from gpu_worker.engines.scheduler.scheduler import Scheduler
    from gpu_worker.execution.executor import ModelExecutor
    from gpu_worker.models.paged import PagedDecoderModel

    rates = measure_copy_rates(device)
    assert rates.source == "measured" and rates.h2d_bytes_per_s > 0 and rates.d2h_bytes_per_s > 0
    prompts = [[(i * 37 + k * 11 + 1) % cfg.vocab_size for k in range(20 + 9 * i)] for i in range(3)]
    runs, stats = {}, {}
    for name in ("plain", "swapped"):
        model = PagedDecoderModel(ModelExecutor(device, compiler), cfg, seed, max_batch_size=8,
                                  prefill_chunk=32)
        model.load()
        budget = HostKVBudget(1 << 30)
        sched = Scheduler(model, model.pool, thread=False, max_batch_size=8,
                          kv_swap=KVSwap(device, model.pool, budget, rates))
        seqs = [sched.submit(p, new_tokens) for p in prompts]
        for step in range(400):
            if not sched.busy():
                break
            if name == "swapped" and step in (2, 5, 9):
                assert sched.preempt_newest()
            sched.step()
        assert not sched.busy()
        runs[name] = [list(s.generated) for s in seqs]
        if name == "swapped":
            stats = sched.stats()
            assert budget.in_use == 0, "host bytes left booked after every swap came back"
        sched.close()
        model.executor.close()
        model.close()
    return runs, stats


def second_model_under_an_exact_budget(runtime: WorkerRuntime, probe: str,
                                       kv_at_load: bool = True) -> str:
    """Load `small` decoder A and serve one request (its plans exist), leave exactly B's probe free
    (`probe`: "content" = the tensors' bytes, "granules" = the committed-byte probe), load B.
    Returns "refused" or "loaded", and asserts the invariant: A still generates the tokens it did
    before (paged back in if B's load paged it out), B (when it loaded) the reference's first token
    or a clean RESOURCE_EXHAUSTED; never a fault.
    Run without a governor (the local budget is the one being squeezed). `kv_at_load=False`: the
    "content" budget leaves B's weights only, since nothing but the admission probe books KV at
    load (a paged decoder commits its pool as sequences grow): without the probe, B's own
    commits must be what overflows."""
    cfg = get_config("small", "decoder")
    runtime.load_model("a", "decoder", "small", 1)
    before = [c[0] for c in runtime.generate("a", PROMPT, 4)]
    reference_b = R.DecoderReference(cfg, W.load_host(cfg, 2)).generate(PROMPT, 1)
    # Retained handles (the host KV tier's copy probe leaves some) are booked but reusable: B's
    # first commits would take them, so "exactly B's probe free" would hide that much headroom.
    runtime.device.arena.release_pool()
    budget = runtime.device.ledger.budget
    need = (cfg.weight_bytes() + (cfg.kv_bytes() if kv_at_load else 0) if probe == "content"
            else admission_bytes(cfg, runtime.device.info.granule_bytes))
    budget.budget_bytes = sum(budget.used().values()) + need
    try:
        runtime.load_model("b", "decoder", "small", 2)
        outcome = "loaded"
    except ResourceExhausted:
        outcome = "refused"
    got = [c[0] for c in runtime.generate("a", PROMPT, 4)]
    assert got == before, f"model a lost its weights when b was loaded ({probe} probe, b {outcome})"
    if outcome == "loaded":
        try:
            got = [c[0] for c in runtime.generate("b", PROMPT, 4)]
            assert got[:1] == reference_b and len(got) == 4, "model b generates wrong tokens"
        except ResourceExhausted:
            pass   # b's first plans do not fit: a clean refusal of the request, not a fault
    return outcome
