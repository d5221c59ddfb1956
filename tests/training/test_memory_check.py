"""The out-of-memory guard: a model that cannot fit stops with one message before anything is written."""

from __future__ import annotations

import math
import re
import types

import pytest
import torch

from components.model import build_on_meta
from runtime import memory_accounting as accounting
from runtime import memory_check
from tests.helpers import compose_root, run_train


def test_k3_full_is_refused_before_any_output(tmp_path):
    # train.py in a process of its own: exit status 2 and one line on stderr are the contract here
    result = run_train("experiment=k3_full", f"output_root={tmp_path}", timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model: training this model needs at least")
    assert "2,779,484,393,568 parameters" in lines[0] and "analysis.model_report" in lines[0]
    assert not any(tmp_path.iterdir())


def _matrix_params_muon_updates(root) -> int:
    from components.optim.param_groups import muon_partition

    model = build_on_meta(root.decoder_config())
    muon, _ = muon_partition(model, root.optimizer.per_head, root.optimizer.per_head_scope)
    return sum(p.numel() for _, p, _ in muon)


def test_floor_counts_weights_gradients_and_each_optimizers_state():
    """fp32 weights and gradients (8 B), AdamW's two moments (8 B) on every parameter; Muon's one momentum
    (4 B) on the matrices it orthogonalises and AdamW's two on the rest."""
    adamw = compose_root("model=tiny", "optimizer=adamw")
    need, n = memory_check.training_floor_bytes(adamw)
    model = build_on_meta(adamw.decoder_config())
    assert n == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) > 0
    assert need == 16 * n
    muon = compose_root("model=tiny", "optimizer=muon")
    matrices = _matrix_params_muon_updates(muon)
    assert 0 < matrices < n
    assert memory_check.training_floor_bytes(muon) == (16 * n - 4 * matrices, n)


def test_floor_is_refused_above_the_memory_and_respects_the_switch(monkeypatch):
    root = compose_root("model=tiny")
    need, n = memory_check.training_floor_bytes(root)
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: need - 1)
    with pytest.raises(memory_check.ConfigError) as err:
        memory_check.check_fits(root)
    assert err.value.key == "model" and f"{n:,} parameters" in str(err.value)
    memory_check.check_fits(compose_root("model=tiny", "trainer.memory_check=false"))
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: need)
    memory_check.check_fits(root)


def test_refusal_names_the_smallest_mesh_that_fits_on_h100_and_h200(monkeypatch):
    """k3_full on a CPU: the message names, for each GPU kind, a mesh whose whole plan fits, and the same
    (ep, checkpointing) one node smaller does not."""
    root = compose_root("experiment=k3_full")
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: 64 * GiB)
    with pytest.raises(memory_check.ConfigError) as err:
        memory_check.check_fits(root)
    message = str(err.value)
    inv = accounting.inventory_for(root)
    for gpu in accounting.GPUS.values():
        found = re.search(
            rf"on {gpu.name}, ([\d,]+) GPUs: trainer=fsdp2 trainer.devices=8 trainer.num_nodes=(\d+)"
            rf"( trainer.expert_parallel=(\d+))?( trainer.activation_checkpointing=true)?",
            message,
        )
        assert found, message
        gpus, nodes = int(found.group(1).replace(",", "")), int(found.group(2))
        ep, ac = int(found.group(4) or 1), bool(found.group(5))
        assert gpus == 8 * nodes
        mesh = accounting.Mesh(gpus, ep, ac, 1, root.data.seq_len)
        assert accounting.plan(inv, mesh, gpu.memory_bytes).fits
        smaller = accounting.Mesh(gpus - 8 * ep // math.gcd(8, ep), ep, ac, 1, root.data.seq_len)
        assert not accounting.plan(inv, smaller, gpu.memory_bytes).fits


# -- which device the check reads, and how (issue 20) ----------------------------------------------------
GiB = 2**30
LAUNCH_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_PROCID", "SLURM_NTASKS")


class FakeCuda:
    """Stands in for ``torch.cuda``'s device functions: ``count`` visible GPUs of ``total`` bytes each, and
    a record of every call with the device index it touches (None for calls that touch no device).
    A call that omits its device acts on the current device, which is index 0 until set_device."""

    def __init__(self, monkeypatch, count: int = 2, total: int = 80 * GiB, available: bool = True):
        self.count, self.total, self.available = count, total, available
        self.calls: list[tuple[str, object]] = []
        self.current = 0
        m = monkeypatch
        m.setattr(torch.cuda, "is_available", lambda: self._rec("is_available", None) or self.available)
        m.setattr(
            torch.cuda, "device_count", lambda: self._rec("device_count", None) or (self.count if self.available else 0)
        )
        m.setattr(torch.cuda, "get_device_properties", self.get_device_properties)
        m.setattr(
            torch.cuda,
            "get_device_capability",
            lambda device=None: self._rec("get_device_capability", self._index(device)) or (9, 0),
        )
        m.setattr(
            torch.cuda,
            "get_device_name",
            lambda device=None: self._rec("get_device_name", self._index(device)) or "Fake GPU",
        )
        m.setattr(
            torch.cuda,
            "mem_get_info",
            lambda device=None: self._rec("mem_get_info", self._index(device)) or (self.total, self.total),
        )
        m.setattr(torch.cuda, "set_device", lambda device: self._set_device(device))
        m.setattr(torch.cuda, "current_device", lambda: self._rec("current_device", self.current) or self.current)
        for name in (
            "init",
            "synchronize",
            "empty_cache",
            "memory_allocated",
            "memory_reserved",
            "max_memory_allocated",
            "cudart",
        ):
            m.setattr(
                torch.cuda, name, lambda *a, _n=name, **k: self._rec(_n, self._index(a[0] if a else k.get("device")))
            )

    def _index(self, device) -> int:
        if device is None:
            return self.current
        if isinstance(device, torch.device):
            return self.current if device.index is None else device.index
        if isinstance(device, str):
            return int(device.split(":")[1]) if ":" in device else self.current
        return int(device)

    def _rec(self, name, index):
        self.calls.append((name, index))  # returns None, so `self._rec(...) or value` gives value

    def _set_device(self, device):
        self.current = self._index(device)
        self._rec("set_device", self.current)

    def get_device_properties(self, device=None):
        index = self._index(device)
        self._rec("get_device_properties", index)
        assert 0 <= index < self.count, f"invalid device index {index}"
        return types.SimpleNamespace(total_memory=self.total, name="Fake GPU", major=9, minor=0)

    def touched(self) -> set:
        return {i for _, i in self.calls if i is not None}

    def names(self) -> set:
        return {n for n, _ in self.calls}


def _as_rank(monkeypatch, rank: int, world: int = 2, **extra: str) -> None:
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    if rank is not None:
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
    for k, v in extra.items():
        monkeypatch.setenv(k, v)


# ids avoid the word "gpu": conftest skips tests with a "gpu" keyword on machines without CUDA
@pytest.mark.parametrize("accelerator", ["gpu", "auto"], ids=["accelerator=gpu", "accelerator=auto"])
def test_each_of_two_ranks_reads_only_its_own_gpu_without_a_context(monkeypatch, accelerator):
    root = compose_root("model=tiny", f"trainer.accelerator={accelerator}", "trainer.devices=2", "trainer.strategy=ddp")
    for rank in (0, 1):  # the check as each rank of a 2-GPU launch runs it
        cuda = FakeCuda(monkeypatch, count=2)
        _as_rank(monkeypatch, rank)
        memory_check.check_fits(root)  # 80 GiB GPUs: fits
        assert cuda.touched() == {rank}, f"rank {rank} touched devices {cuda.touched()}: {cuda.calls}"
        assert ("get_device_properties", rank) in cuda.calls
        # mem_get_info creates a context on the device it asks (the old 0.3-0.5 GiB per rank on GPU 0);
        # nothing binds or queries a current device either (that would default to GPU 0)
        assert not cuda.names() & {"mem_get_info", "set_device", "current_device", "cudart", "init"}, cuda.calls


def test_rank_one_never_touches_gpu_zero_whichever_launcher(monkeypatch):
    root = compose_root("model=tiny", "trainer.accelerator=cuda", "trainer.devices=2", "trainer.strategy=ddp")
    for env in ({"LOCAL_RANK": "1"}, {"SLURM_LOCALID": "1"}):  # torchrun / Lightning-spawned; srun
        cuda = FakeCuda(monkeypatch, count=2)
        _as_rank(monkeypatch, None, **env)
        assert memory_check.available_bytes(root)[0] == 80 * GiB
        assert 0 not in cuda.touched() and cuda.touched() == {1}, cuda.calls
        assert "mem_get_info" not in cuda.names()


def test_device_index_follows_lightning_device_lists_and_per_task_binding(monkeypatch):
    _as_rank(monkeypatch, 1)
    assert memory_check.local_device_index([2, 3], visible=4) == 3  # Lightning: rank r uses devices[r]
    assert memory_check.local_device_index(2, visible=2) == 1
    assert memory_check.local_device_index("auto", visible=2) == 1
    root = compose_root("model=tiny", "trainer.accelerator=gpu", "trainer.devices=[2,3]", "trainer.strategy=ddp")
    cuda = FakeCuda(monkeypatch, count=4)
    memory_check.check_fits(root)
    assert cuda.touched() == {3}, cuda.calls
    _as_rank(monkeypatch, None, SLURM_LOCALID="1")
    assert memory_check.local_device_index(2, visible=1) == 0  # srun --gpus-per-task: each task sees its GPU as 0
    _as_rank(monkeypatch, None)
    assert memory_check.local_device_index(2, visible=2) == 0  # one process / the launching rank


def test_auto_with_a_gpu_compares_against_gpu_memory(monkeypatch):
    root = compose_root("model=tiny", "trainer.accelerator=auto")
    need, _ = memory_check.training_floor_bytes(root)
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: 1024 * GiB)  # host RAM would fit it
    _as_rank(monkeypatch, None)
    FakeCuda(monkeypatch, count=1, total=need - 1)  # a GPU just too small
    with pytest.raises(memory_check.ConfigError) as err:
        memory_check.check_fits(root)
    assert err.value.key == "model" and "on one GPU" in str(err.value)
    # a faked 1 GiB GPU against a model that needs more: refused although host RAM fits it
    monkeypatch.setattr(memory_check, "training_floor_bytes", lambda root: (2 * GiB, 2 * GiB // 16))
    FakeCuda(monkeypatch, count=1, total=1 * GiB)
    with pytest.raises(memory_check.ConfigError, match=r"more than the 1.0 GiB on one GPU \(1.0 GiB each\)"):
        memory_check.check_fits(root)
    memory_check.check_fits(compose_root("model=tiny", "trainer.accelerator=auto", "trainer.memory_check=false"))


def test_auto_without_a_gpu_and_cpu_runs_use_host_ram_and_no_cuda(monkeypatch):
    _as_rank(monkeypatch, None)
    monkeypatch.setattr(memory_check, "_mem_available_bytes", lambda: 7 * GiB)
    cuda = FakeCuda(monkeypatch, available=False)
    assert memory_check.available_bytes(compose_root("model=tiny", "trainer.accelerator=auto")) == (
        7 * GiB,
        "of memory available on this machine",
    )
    assert cuda.names() <= {"is_available"}
    cuda = FakeCuda(monkeypatch, count=2)  # a GPU is there, but the run is on the CPU: CUDA is not touched
    assert memory_check.available_bytes(compose_root("model=tiny", "trainer.accelerator=cpu"))[0] == 7 * GiB
    assert cuda.calls == []


def test_fully_sharded_gpu_run_compares_each_gpu_with_its_shard_and_largest_unit(monkeypatch):
    root = compose_root(
        "model=tiny", "trainer.accelerator=gpu", "trainer.devices=2", "trainer.num_nodes=2", "trainer.strategy=fsdp2"
    )
    _as_rank(monkeypatch, 1)
    cuda = FakeCuda(monkeypatch, count=2, total=10 * GiB)
    assert memory_check.available_bytes(root) == (10 * GiB, "of each of the 4 sharded GPUs")
    assert cuda.touched() == {1}
    whole, _ = memory_check.training_floor_bytes(root)
    floor = accounting.floor_bytes(accounting.inventory_for(root), 4, 1, root.trainer.precision)
    # a quarter of the state each (FSDP2 pads dimension 0 to the group, so a little more), plus one unit
    assert whole / 4 <= floor["state"] < whole / 4 * 1.05 and floor["largest_unit"] > 0
    FakeCuda(monkeypatch, count=2, total=floor["total"])
    memory_check.check_fits(root)
    FakeCuda(monkeypatch, count=2, total=floor["total"] - 1)
    with pytest.raises(
        memory_check.ConfigError, match=r"per GPU on 4 sharded GPUs .* largest unit \((embed|lm_head|layers\.\d+)\)"
    ):
        memory_check.check_fits(root)


def test_expert_parallel_shrinks_the_gathered_unit_the_check_counts(monkeypatch):
    """The same sharded MoE run: refused with every rank gathering all experts of a layer, accepted with
    trainer.expert_parallel=2 on GPUs whose memory lies between the two floors."""
    moe = ("ffn=moe", "ffn.num_experts=16", "ffn.expert_hidden_dim=1024")  # experts make the largest unit
    common = ("model=tiny", *moe, "trainer.accelerator=gpu", "trainer.devices=2", "trainer.strategy=fsdp2")
    _as_rank(monkeypatch, 0)
    inv = accounting.inventory_for(compose_root(*common))
    plain, split = (accounting.floor_bytes(inv, 2, ep, "32-true")["total"] for ep in (1, 2))
    assert split < plain and accounting.gathered_peak(inv, 1)["largest_unit"].startswith("layers.")
    FakeCuda(monkeypatch, count=2, total=split)
    memory_check.check_fits(compose_root(*common, "trainer.precision=32-true", "trainer.expert_parallel=2"))
    with pytest.raises(memory_check.ConfigError, match=r"\(expert_parallel 1\)"):
        memory_check.check_fits(compose_root(*common, "trainer.precision=32-true"))


def test_bf16_mixed_gathers_units_at_half_the_bytes(monkeypatch):
    """FSDP2's mixed-precision policy gathers bf16 parameters: the check counts the gathered unit at 2 bytes
    a number under bf16-mixed (shards stay fp32), so a GPU between the two floors takes bf16 and not fp32."""
    common = ("model=tiny", "trainer.accelerator=gpu", "trainer.devices=2", "trainer.strategy=fsdp2")
    _as_rank(monkeypatch, 0)
    inv = accounting.inventory_for(compose_root(*common))
    bf16, fp32 = (accounting.floor_bytes(inv, 2, 1, p) for p in ("bf16-mixed", "32-true"))
    assert bf16["state"] == fp32["state"] and 2 * bf16["largest_unit"] == fp32["largest_unit"] > 0
    FakeCuda(monkeypatch, count=2, total=bf16["total"])
    memory_check.check_fits(compose_root(*common, "trainer.precision=bf16-mixed"))
    with pytest.raises(memory_check.ConfigError, match="largest unit"):
        memory_check.check_fits(compose_root(*common, "trainer.precision=32-true"))
