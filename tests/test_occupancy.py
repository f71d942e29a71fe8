"""The thread governor: fewer threads while other processes keep cores busy, the tuned count again after; the
premise that this never changes a result (the fused step gives the same bits with any thread count)."""

import torch
from helpers import tiny_model

from speculant.runtime import occupancy
from speculant.runtime.executor import executor_of
from speculant.runtime.formats import apply_weight_format


def test_wanted_counts_cores_taken_elsewhere():
    gov = occupancy.ThreadGovernor(2, cores=2)
    assert [gov.wanted(o) for o in (0.0, 0.3, 0.49, 0.6, 1.0, 1.9, 5.0)] == [2, 2, 2, 1, 1, 1, 1]
    gov8 = occupancy.ThreadGovernor(4, cores=8)
    assert [gov8.wanted(o) for o in (0.0, 4.0, 4.6, 6.0, 7.9)] == [4, 4, 3, 2, 1]


def test_the_count_follows_the_load_after_two_windows_that_agree(monkeypatch):
    """A fake machine: 2 cores, this process using one, another process using 0 then 1 then 0 cores."""
    clock = {"t": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(occupancy.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(occupancy, "cpu_seconds", lambda: (clock["busy"], 0.0))
    monkeypatch.setattr(occupancy, "own_cpu_seconds", lambda: clock["own"])
    set_to = []
    monkeypatch.setattr(occupancy.torch, "set_num_threads", set_to.append)
    gov = occupancy.ThreadGovernor(2, cores=2, window=0.25)      # its first window starts here

    def window(others, own=1.0, dt=0.3):
        clock["t"] += dt
        clock["own"] += own * dt
        clock["busy"] += (own + others) * dt
        return gov.tick()

    assert window(0.0) == 2 and gov.others == 0.0
    assert window(1.0) == 2                  # one window asks for 1 thread: not yet
    assert window(1.0) == 1 and set_to == [1]
    clock["t"] += 0.1
    assert gov.tick() == 1 and set_to == [1]     # within a window: no reading
    assert window(0.0, dt=0.2) == 1              # the other process stopped: one window
    assert window(0.0) == 2 and set_to == [1, 2]
    assert window(1.0) == 2 and window(0.0) == 2 and set_to == [1, 2]   # one noisy window changes nothing


def test_without_proc_stat_nothing_changes(monkeypatch):
    monkeypatch.setattr(occupancy, "cpu_seconds", lambda: None)
    gov = occupancy.ThreadGovernor(2, cores=2, window=0.0)
    assert gov.tick() == 2 and gov.tick() == 2


def test_the_fused_step_gives_the_same_bits_with_any_thread_count():
    """The governor's premise: changing the thread count between rounds cannot change a result."""
    import pytest

    from speculant.kernels import build
    if not build.available():        # no fused step here, so no governor either
        pytest.skip(f"kernels: {build.unavailable_reason()}")
    m = tiny_model(seed=2, vocab=96, layers=2, hidden=64, heads=4, kv_heads=2, inter=128)
    apply_weight_format(m.decoder, "w4a8")
    ex = executor_of(m)
    assert ex.fused_layers() is not None
    ids = torch.randint(96, (1, 40), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = ex.new_cache(48)
            with torch.inference_mode():
                ex(ids[:, :32], None, None, cache, 0)
                out[n] = ex(ids[:, 32:], None, None, cache, 32)       # an 8-row block over the cache
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])


def test_a_long_reading_decides_alone(monkeypatch):
    """From a model's load to its first prompt: one reading over many windows is enough."""
    clock = {"t": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(occupancy.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(occupancy, "cpu_seconds", lambda: (clock["busy"], 0.0))
    monkeypatch.setattr(occupancy, "own_cpu_seconds", lambda: clock["own"])
    monkeypatch.setattr(occupancy.torch, "set_num_threads", lambda n: None)
    gov = occupancy.ThreadGovernor(2, cores=2, window=0.1)
    clock["t"] += 0.3
    clock["busy"] += 0.3
    clock["own"] += 0.3
    assert gov.tick() == 2 and gov._pending is None      # a short quiet window
    clock["t"] += 0.3
    clock["busy"] += 0.3
    assert gov.tick() == 2                       # a short window with a core's worth elsewhere: not yet
    clock["t"] += 0.3
    clock["own"] += 0.3
    clock["busy"] += 0.3
    assert gov.tick() == 2 and gov._pending is None      # quiet again
    clock["t"] += 2.0
    clock["own"] += 1.0
    clock["busy"] += 3.0                         # 1 core ours, 1 core someone else's, for 2 s
    assert gov.tick() == 1


def test_other_cores_is_the_machines_busy_time_less_this_process(monkeypatch):
    """Between two readings: 3 busy CPU seconds of which 1 was this process's, over 2 s of wall: 1 core elsewhere."""
    now = (102.0, 13.0, 6.0)                                    # (wall, machine busy, this process) [s]
    assert occupancy.other_cores((100.0, 10.0, 5.0), now) == 1.0
    assert occupancy.other_cores((100.0, 10.5, 4.0), now) == 0.25                # this process did more
    assert occupancy.other_cores(None, now) is None and occupancy.other_cores(now, now) is None
    monkeypatch.setattr(occupancy, "reading", lambda: now)               # the default end: a reading now
    assert occupancy.other_cores((100.0, 10.0, 5.0)) == 1.0


def test_a_tune_measured_beside_other_work_says_so(tmp_path, monkeypatch):
    """A first measurement while other processes kept a core busy is recorded (``busy_cores``), said on the log with
    the command that measures again (for the model as it was named), and shown by the tune's table; a quiet one is recorded and says nothing."""
    import io

    from speculant.runtime import tune
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    model = tiny_model(seed=3, vocab=96, hidden=64, heads=4, kv_heads=2, inter=128)
    real = tune.measure
    monkeypatch.setattr(tune, "measure", lambda *a, **k: real(*a, repeats=1, **k))
    for others, said in ((1.2, True), (0.1, False)):
        monkeypatch.setattr(occupancy, "other_cores", lambda since, now=None, o=others: o)
        log = io.StringIO()
        result = tune.load_or_measure(model.decoder, threads=1, log=log, force=True, model="/models/my model.gguf")
        assert result.busy_cores == others and tune.load(result.key).busy_cores == others       # saved with it
        assert ("cores busy while this machine was measured" in log.getvalue()) == said
        assert ("run `speculant tune --model '/models/my model.gguf'` then" in log.getvalue()) == said
        assert ("while other processes kept 1.2 cores busy" in tune.format_table(result)) == said
