"""The gate's setup as a Python user writes it (programs/gate.py): the queue it needs, the
address its context-parallel trainer attaches by, its training step."""

import os

import pytest

from treeflow.programs import Gate, gate_address, gate_reduce
from treeflow.stages import Reduce


def test_the_queue_must_hold_both_rounds():
    gate = Gate(episodes=16)
    gate.check_capacity(32)
    with pytest.raises(ValueError, match=r"^--capacity 31: the gate's two rounds of --episodes 16 "
                                         r"must fit the queue; give >= 32$"):
        gate.check_capacity(31)


def test_a_context_parallel_trainer_gets_an_address():
    assert gate_address(1, "embedded") is None            # in-process queue, one trainer
    assert gate_address(2, "embedded", "q.sock") == "q.sock"
    assert gate_address(2, "transferqueue") == "gate"
    path = gate_address(2, "embedded")
    assert os.path.basename(path) == "q.sock" and os.path.isdir(os.path.dirname(path))
    assert gate_address(2, "embedded") != path            # a private directory each time


def test_the_gates_step_is_one_policy_gradient_step():
    reduce = gate_reduce(3e-4)
    assert isinstance(reduce, Reduce)
    assert reduce.loss.kind == "pg" and reduce.schedule.lr == 3e-4
    assert gate_reduce().schedule.lr == 1e-5
