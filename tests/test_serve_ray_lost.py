"""serve-ray when its only replica cannot come back (its own module, so that its cluster holds no other
serve-ray: one Ray Serve per cluster, one HTTP port)."""

import os
import shutil
import time

import openai
import pytest

from tests.test_serve_ray import BUDGET_MB, _chat, _client, cluster, model_path, serve_ray  # noqa: F401 (fixtures)


@pytest.mark.slow
def test_a_request_is_answered_503_when_no_replica_comes_back(cluster, model_path, tmp_path):  # noqa: F811
    """The only replica killed and its model file gone, so its replacement cannot start: a new request is not
    queued for ever but answered 503 (retryable) once no replica has reported for NO_REPLICA_S."""
    import ray

    from moestream.distributed.replica_metrics import STALE_S
    from moestream.distributed.serve_app import NO_REPLICA_S

    own = str(tmp_path / "own.gguf")
    shutil.copy(model_path, own)
    with serve_ray(
        cluster, tmp_path, "-m", own, "--replicas", "1", "--threads", "1", "--ram-budget-mb", BUDGET_MB, replicas=1
    ) as url:
        client = _client(url)
        _, victim, _ = _chat(client, [{"role": "user", "content": "hello"}], max_tokens=2)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            os.remove(own)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::moestream#EngineReplica#{victim}", namespace="serve"))
        finally:
            ray.shutdown()
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            _chat(client, [{"role": "user", "content": "anyone there?"}], max_tokens=2)
        waited = time.monotonic() - t0
        err = caught.value
        assert err.status_code == 503 and err.response.headers["retry-after"] == "1"
        assert err.body["code"] == "no_replica" and "retry" in err.body["message"]
        assert waited < NO_REPLICA_S + STALE_S + 15
