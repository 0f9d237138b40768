"""Pacing a long prompt's chunks beside decoding requests: on average the budget a pass, in chunks that
each cost about ``CHUNK_PASSES`` budgets, whatever a chunk's cost (measured on 2 cores: reading the
request's cache costs a chunk pass more the longer the prompt)."""

from specmesh.runtime.prefill_pace import CHUNK_PASSES, PrefillPace


def chunk_ms(rows: int, cached: int) -> float:
    """The embedded target beside 4 decoding requests, 2 cores: one read of the cache, then each token."""
    return 0.004 * cached + rows * (0.6 + 0.00085 * cached)


def test_chunks_cost_the_budget_on_average_and_a_few_budgets_each():
    pace, budget, cached, passes, spent, chunk_passes = PrefillPace(), 8.0, 0, 0, 0.0, []
    while cached < 2800:
        passes += 1
        rows = min(pace.grant(budget), 2800 - cached)
        if rows:
            added = chunk_ms(rows, cached)
            pace.spent(rows, added, budget, 512)
            spent += added
            chunk_passes.append(added)
            cached += rows
    assert abs(spent / passes - budget) < 0.1 * budget  # the neighbours' share, on average
    settled = chunk_passes[5:-1]  # once the size is learnt (the last chunk is the remainder)
    assert all(CHUNK_PASSES * budget * 0.5 < ms < CHUNK_PASSES * budget * 2 for ms in settled)
    assert len(chunk_passes) < passes  # passes between chunks pay for them


def test_credit_does_not_pile_up_and_other_chunks_are_paid_for():
    pace = PrefillPace()
    for _ in range(100):
        pace.grant(5.0)
    assert pace.bank_ms == CHUNK_PASSES * 5.0  # idle passes bank at most one chunk's worth
    rows = pace.rows
    pace.spent(0, 40.0, 5.0, 512)  # a new request's first chunk beside decoding: paid for, sizes nothing
    assert pace.rows == rows and pace.grant(5.0) == 0  # overdrawn: the next passes decode only
    for _ in range(6):
        pace.grant(5.0)
    assert pace.grant(5.0) == rows


def test_alone_a_pass_takes_about_its_budget_as_the_cache_grows():
    """With no one decoding, chunks are sized on the last pass's time: no line over rows fits a whole prompt
    (on 2 cores, alone passes sized on one took 300 ms of a 200 ms budget by 1,000 positions)."""
    pace, cached, times = PrefillPace(), 0, []
    while cached < 6000:
        rows = pace.alone_rows
        ms = 3.0 + chunk_ms(rows, cached)
        pace.alone(rows, ms, 200.0, 512)
        cached += rows
        times.append(ms)
    assert all(150 < ms < 260 for ms in times[8:])


def test_a_bursts_first_chunks_size_the_next_alone_passes_at_once():
    """64 new requests' first chunks (64 rows each) in a 70 ms pass alone: the next alone passes take about
    the budget, not a few rows growing twice a pass."""
    pace = PrefillPace()
    pace.alone(64 * 64, 70.0, 50.0, 2048)
    assert pace.alone_rows == 2048
    pace.alone(1000, 20.0, 50.0, 4096)
    assert pace.alone_rows == 2000


def test_the_first_chunk_paced_after_alone_passes_is_sized_on_them():
    """A burst's last prompt, once the others decode, is paced from what the alone passes measured, not from
    a few rows doubling a pass."""
    pace = PrefillPace()
    pace.alone(1000, 20.0, 50.0, 2048)  # 0.02 ms a row
    assert pace.grant(4.0) == round(CHUNK_PASSES * 4.0 / 0.02)
    pace.spent(400, 10.0, 4.0, 512)
    assert pace.rows == 320  # then sized on what the chunks paced cost, as ever
