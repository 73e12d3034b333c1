"""The trainer's rollout sources (rollout_sources.py), each alone, against a driver that records
what it is asked (the real driver runs them end to end in test_trainer*.py)."""
from concurrent.futures import Future

from spice_megatron.loop.driver import IterationAbandoned
from spice_megatron.loop.interfaces import RolloutBatch
from spice_megatron.loop.rollout_sources import OneStepOff, OnPolicy, Rollouts
from spice_megatron.rollout.fleet import NoEngineLeft


class RecordingDriver:
    """The driver's rollout calls: each iteration's batch, or the failure set for it (once)."""

    def __init__(self, failures=None):
        self.calls, self.failures = [], failures or {}

    def _batch(self, iteration, version):
        if iteration in self.failures:
            raise self.failures.pop(iteration)
        return RolloutBatch(iteration, version, {"valid_task_rate": 1.0}, [], [])

    def selfplay(self, iteration, version):
        self.calls.append(("selfplay", iteration, version))
        return self._batch(iteration, version)

    def start_selfplay(self, iteration, version):
        self.calls.append(("start", iteration, version))
        future = Future()
        try:
            future.set_result(self._batch(iteration, version))
        except (NoEngineLeft, IterationAbandoned) as e:
            future.set_exception(e)
        return future, {"sampler": f"before {iteration}"}

    def state(self):
        return {"sampler": "now"}


def test_on_policy_rolls_out_each_iteration_on_the_current_weights():
    driver = RecordingDriver({1: NoEngineLeft("gone"), 2: IterationAbandoned()})
    source = OnPolicy(driver)
    got = source.collect(0, 0)
    assert got.batch.iteration == 0 and not got.lost and source.wait() == ("", 0.0)
    assert source.collect(1, 1).lost == "gone" and source.collect(2, 1).abandoned
    source.start_next(3, 1)  # nothing runs ahead
    assert driver.calls == [("selfplay", 0, 0), ("selfplay", 1, 1), ("selfplay", 2, 1)]
    assert source.state() == {"driver": {"sampler": "now"}, "ready": None}
    assert OnPolicy(None).collect(0, 0) == Rollouts()  # a rank that is not the driver


def test_one_step_off_trains_on_the_batch_rolled_out_during_the_last_step_and_checkpoints_it():
    driver = RecordingDriver()
    source = OneStepOff(driver, iterations=4, ready=None)
    got = source.collect(0, 0)  # the first batch on-policy, the second started on the same weights
    assert got.batch.iteration == 0 and driver.calls == [("selfplay", 0, 0), ("start", 1, 0)]
    assert source.state()["driver"] == {"sampler": "before 1"}  # a checkpoint now starts iteration 1 again
    lost, _ = source.wait()
    assert lost == "" and source.ready.iteration == 1 and source.state()["driver"] == {"sampler": "now"}
    source.start_next(2, 1)  # after iteration 1 is logged: iteration 2 on the new weights
    assert source.collect(1, 1).batch.iteration == 1 and driver.calls[-1] == ("start", 2, 1)
    source.wait()
    source.start_next(4, 2)  # past the last iteration: nothing starts
    assert driver.calls[-1] == ("start", 2, 1)
    # a checkpoint holds the waiting batch, and a resumed source trains on it first
    resumed = OneStepOff(RecordingDriver(), iterations=4, ready=source.state()["ready"])
    assert resumed.collect(2, 2).batch.iteration == 2


def test_one_step_off_rolls_out_again_when_the_engines_were_lost_during_the_step():
    driver = RecordingDriver({1: NoEngineLeft("all engines died")})
    source = OneStepOff(driver, iterations=3, ready=None)
    source.collect(0, 0)
    assert source.wait()[0] == "all engines died" and source.ready is None
    got = source.collect(1, 1)  # nothing waits: the driver is asked again, on-policy, on the new weights
    assert got.batch.iteration == 1 and driver.calls[-2:] == [("selfplay", 1, 1), ("start", 2, 1)]
