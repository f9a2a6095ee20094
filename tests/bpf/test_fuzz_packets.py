"""Random and mutated packets through the real XDP program (BPF_PROG_TEST_RUN) beside the reference
model: the program never aborts, agrees with the model on every verdict and every byte it sends,
and counts every packet it does not serve (a drop by its reason, in the job's bucket or the no-job
one); the counters of both agree after every sequence. Packets of tests/fixtures/fuzz.py."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.fuzz import WORLD, check_accounted, message, snapshot
from tests.fixtures.scenarios import entry
from tests.fixtures.traffic import STRATEGY_TEXTS
from tests.harness.equivalence import member

from .conftest import ELEMENTS

pytestmark = pytest.mark.root


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(text=st.sampled_from(STRATEGY_TEXTS),
       packets=st.lists(message(ELEMENTS, member), min_size=1, max_size=40))
def test_random_and_mutated_packets_are_refused_and_counted_as_the_model_says(harness, text, packets):
    harness.start(WORLD, 2, 8, [entry(text)])
    for i, (data, src) in enumerate(packets):
        before = snapshot(harness.model)
        v = harness.send(data, src, 1_000_000 + 1000 * i, where=f"packet {i}")
        check_accounted(harness.model, data, v, before)
    harness.check_counters()
