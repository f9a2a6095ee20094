"""torch_train's switches that need no lab: the hook's settings, record paths."""
from __future__ import annotations

import pytest

from aggd.training.torch_train import out_path


def test_comm_aggd_hook_without_the_environment_names_what_is_missing(monkeypatch):
    from aggd.training.torch_train import aggd_env
    for k in ("AGGD_SERVER", "AGGD_JOB", "AGGD_TOKEN", "AGGD_BIND"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AGGD_JOB", "j")
    with pytest.raises(RuntimeError, match="AGGD_SERVER, AGGD_TOKEN"):
        aggd_env()
    monkeypatch.setenv("AGGD_SERVER", "10.0.0.1:47000")
    monkeypatch.setenv("AGGD_TOKEN", "t")
    assert aggd_env() == (("10.0.0.1", 47000), "j", "t", ("0.0.0.0", 0))


def test_record_paths():
    assert str(out_path("/x/r{rank}.json", 3)) == "/x/r3.json"
    assert str(out_path("/x/run", 1)) == "/x/run.rank1.json"
