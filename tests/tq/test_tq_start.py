"""A TransferQueue start that cannot finish is said while it waits, and leaves nothing behind.

In a CI run at load 60 a first start took longer than its deadline; the detached host actor it
left half-started made every later start on the cluster wait on it and fail as well. The test
holds every free CPU of the session's cluster so that the controller cannot start, and checks
that the start says what it waits for, stops its host on timeout, and that a start once the CPUs
are back succeeds.
"""

import pytest

from tests.ray_helpers import wait_for_free_cpus
from tests.tq.queue_helpers import close_transferqueue

pytestmark = pytest.mark.ray
tq = pytest.importorskip("transfer_queue")


def test_a_start_without_cpus_times_out_says_why_and_stops_its_host(ray_cluster, capsys,
                                                                     monkeypatch):
    import ray

    from treeflow.tq import transferqueue

    close_transferqueue(ray_cluster)  # no host from an earlier module: this test starts one
    free = wait_for_free_cpus(ray_cluster)

    @ray.remote
    class Hold:
        def ready(self):
            return True

    hold = Hold.options(num_cpus=free).remote()  # every CPU: the controller cannot be placed
    ray.get(hold.ready.remote())
    monkeypatch.setattr(transferqueue, "SLOW_START", 1.0)
    try:
        with pytest.raises(TimeoutError, match=r"did not start within 4 s \(0 CPUs free.*"
                                               r"host actor was stopped"):
            transferqueue.init_transferqueue(tq, timeout=4.0)
        assert "TransferQueue is still starting after 1 s (0 CPUs free" in capsys.readouterr().err
        with pytest.raises(ValueError):  # the half-started host is gone
            ray.get_actor(transferqueue._HOST, namespace=transferqueue._NAMESPACE)
    finally:
        ray.kill(hold)
    wait_for_free_cpus(ray_cluster)
    transferqueue.init_transferqueue(tq, timeout=transferqueue.START_TIMEOUT)  # afresh, and up
    assert ray.get(ray.get_actor(transferqueue._HOST,
                                 namespace=transferqueue._NAMESPACE).ready.remote())
    close_transferqueue(ray_cluster)
