"""Two gloo ranks holding different numbers of scored tokens get the one-process gradient."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_losses(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x @ weight).pow(2).sum(-1)  # [N] one loss per scored token


def _rank(rank: int, port: int, shares: list[torch.Tensor], weight: torch.Tensor, out: mp.Queue) -> None:
    import torch.distributed as dist

    from runtime.data_parallel_loss import global_token_mean

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    w = weight.clone().requires_grad_(True)
    x = shares[rank]
    loss_for_grad, logged = global_token_mean(_token_losses(w, x).sum(), torch.tensor(x.shape[0]))
    loss_for_grad.backward()
    dist.all_reduce(w.grad)
    w.grad /= 2  # what DDP does with gradients
    # plain lists: a tensor would travel as a shared file descriptor, which dies with this process
    out.put((rank, w.grad.tolist(), logged.item()))
    dist.destroy_process_group()


def test_uneven_ranks_match_one_process():
    torch.manual_seed(0)
    weight = torch.randn(4, 3)
    tokens = torch.randn(10, 4)
    shares = [tokens[:7], tokens[7:]]  # 7 scored tokens on rank 0, 3 on rank 1

    w = weight.clone().requires_grad_(True)
    reference = _token_losses(w, tokens).mean()
    reference.backward()

    # spawn, not fork: a forked child of a process that already ran OpenMP-parallel kernels can hang
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, shares, weight, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _, grad, logged in results:
        torch.testing.assert_close(torch.tensor(grad), w.grad)
        assert logged == pytest.approx(reference.item(), rel=1e-6)
