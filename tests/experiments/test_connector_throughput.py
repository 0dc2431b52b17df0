"""experiments/connector_throughput.py: pdserve's KV link and the raw pyzmq baselines through the same processes,
each payload made before its clock starts."""

from tests.experiments import load_experiment
from tests.planner.test_kv_link import SLOW_S, run_link

connector_throughput = load_experiment("connector_throughput")


def test_raw_and_pdserve_scenarios_run_side_by_side_untimed_payloads(monkeypatch):
    scenarios = [("tcp", mode, 1, connector_throughput.messages_per_request(mode, 1, 4), 2, "tcp://127.0.0.1:0")
                 for mode in ("kv", "raw", "raw-one")]
    sent = run_link(monkeypatch, scenarios, connector_throughput.send_any, connector_throughput.receive_any)
    assert sorted(sent) == [0, 1, 2]
    assert all(seconds < SLOW_S for seconds in sent.values()), sent
