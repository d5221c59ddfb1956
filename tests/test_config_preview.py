"""``train.py --help`` and ``--cfg``: the composed config as a run would see it, choices without schema entries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from components.registry import FAMILIES
from tests.helpers import train_command_in_process


@pytest.fixture
def train_py(capsys):
    """``train.py args...``'s command line in this process: its exit status and what it printed."""

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        status = train_command_in_process(*args)
        printed = capsys.readouterr()
        return SimpleNamespace(returncode=status, stdout=printed.out, stderr=printed.err)

    return run


def test_cfg_job_resolve_fills_the_vocabulary_from_the_data(train_py):
    for data, vocab in (("code", 8192), ("corpus", 257)):  # a tokenizer's size; the byte corpus's own
        out = train_py("--cfg", "job", "--resolve", f"data={data}")
        assert out.returncode == 0, out.stderr
        cfg = yaml.safe_load(out.stdout)
        assert cfg["model"]["vocab_size"] == vocab == cfg["data"]["vocab_size"]
        assert "hydra" not in cfg


def test_cfg_package(train_py):
    out = train_py("--cfg", "job", "--package", "mixer", "mixer=kda")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# @package mixer\n") and yaml.safe_load(out.stdout)["name"] == "kda"


def test_cfg_refuses_bad_values_naming_them(train_py):
    out = train_py("--cfg", "jobs")
    assert out.returncode == 2 and "--cfg: 'jobs' is not allowed" in out.stderr and "Traceback" not in out.stderr


def test_help_offers_every_member_and_no_schema_entries(train_py):
    out = train_py("--help")
    assert out.returncode == 0, out.stderr
    assert "_schema" not in out.stdout
    choices = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].split(", ")
        for line in out.stdout.splitlines()
        if line.startswith("  ") and not line.startswith("   ") and ":" in line
    }
    for group, registry in FAMILIES.items():
        assert sorted(c.strip() for c in choices[group]) == registry.names(), group
    assert "vocab_size: ${data.vocab_size}" in out.stdout  # the default config follows, unresolved


def test_cfg_hydra_resolves_the_slurm_launcher_in_process(capsys):
    """``--cfg hydra --resolve`` resolves the hydra node inside the whole config: the launcher's shape comes
    from the trainer (``trainer.num_nodes`` / ``devices``) and its folder from ``output_root``."""
    from runtime.train_command import main

    argv = ["hydra/launcher=slurm", "trainer=slurm", "trainer.num_nodes=3", "output_root=/runs", "--cfg", "hydra"]
    assert main([*argv, "--resolve"]) == 0
    launcher = yaml.safe_load(capsys.readouterr().out)["hydra"]["launcher"]
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (3, 8, 8)
    assert launcher["submitit_folder"].startswith("/runs/sweeps/") and "${" not in launcher["submitit_folder"]
    assert main(argv) == 0  # unresolved: the references themselves
    assert yaml.safe_load(capsys.readouterr().out)["hydra"]["launcher"]["nodes"] == "${trainer.num_nodes}"


def test_cfg_all_resolves_hydra_and_job_together(capsys):
    from runtime.train_command import main

    assert main(["--cfg", "all", "--resolve", "output_root=/runs"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["hydra"]["run"]["dir"].startswith("/runs/adhoc/") and cfg["hydra"]["job"]["num"] == 0
    assert cfg["model"]["vocab_size"] == cfg["data"]["vocab_size"] > 0
    assert main(["-m", "--cfg", "hydra", "--resolve", "output_root=/runs"]) == 0  # a multirun's first job
    hydra = yaml.safe_load(capsys.readouterr().out)["hydra"]
    assert hydra["runtime"]["output_dir"] == f"{hydra['sweep']['dir']}/0"
