"""spawn() when free_port()'s port is taken before rank 0 listens on it: started again."""

import socket

import pytest

from treeflow.train import launch

pytestmark = pytest.mark.multiprocess


def _group_rank() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # torchrun's variables, from spawn
    x = torch.ones(1)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return int(x.item())


def test_a_port_taken_before_rank_0_listens_is_tried_again(monkeypatch, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
        assert launch.spawn(_group_rank, 2, timeout_s=120, threads=1) == [2, 2]
    err = capsys.readouterr().err
    assert f"port {port} was taken before rank 0 listened on it" in err


def test_a_port_taken_every_time_fails_naming_it(monkeypatch):
    # started again once, then refused: each attempt starts both ranks (torch, the group), so
    # two attempts stand for the default three, which only repeat the second
    assert launch._PORT_ATTEMPTS == 3
    monkeypatch.setattr(launch, "_PORT_ATTEMPTS", 2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="could not listen on a free port 2 times"):
            launch.spawn(_group_rank, 2, timeout_s=120, threads=1)
