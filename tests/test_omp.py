"""One place decides the OpenMP wait policy: PASSIVE unless the user chose a policy or a spin count."""

from inflight import omp
from inflight.launcher.triton_dist import server_env


def test_passive_by_default_and_the_users_choice_kept():
    assert omp.environment({})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert omp.environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in omp.environment({"GOMP_SPINCOUNT": "10000"})
    assert omp.threads_sleep({"OMP_WAIT_POLICY": "passive"}) and not omp.threads_sleep({})


def test_the_server_and_this_test_process_get_it(monkeypatch):
    import os

    assert os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT")  # tests/conftest.py applied it
    dist = type("Dist", (), {"lib_dirs": [], "from_wheel": False, "stub_python_bin": None})()
    monkeypatch.setattr("inflight.launcher.triton_dist.stub_python_bin", lambda d: "/nonexistent")
    assert server_env(dist, base={})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert server_env(dist, base={"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
