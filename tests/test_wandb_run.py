"""wandb, as a cluster user meets it (real wandb, offline: no network here).

- The run id is the run folder's (``run_folder.WANDB_ID``): a requeued or resumed run logs
  to the same wandb run, a run of the same name in another folder (another user's, another
  sweep's) and a ``--resume none`` restart to a new one. It was ``config.name``, so all of
  them merged into one wandb run.
- ``log.wandb_mode=online`` takes the credentials wandb itself would find: also the
  ``~/.netrc`` that ``wandb login`` writes (it looked at ``WANDB_API_KEY`` only, and went
  offline silently after a ``wandb login``); without any it says so once and logs offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _multiproc import run_ranks
from _training import exits, train_runs

from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.run.folder import WANDB_ID
from cqk_megatron.training.metrics import wandb_mode

pytest.importorskip("wandb")

OFFLINE = [
    "log.wandb_mode=offline",
    "train.train_steps=4",
    "train.checkpoint.save_interval=2",
    "train.eval_interval=100",
    "train.resilience.check_replicas_interval=0",
]


def wandb_ids(run_dir: Path) -> list[str]:
    """The ids of the wandb runs logged in ``run_dir``, in order (wandb names each offline
    run's folder ``offline-run-<time>-<id>``)."""
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    return [folder.name.rsplit("-", 1)[1] for folder in folders]


def test_the_wandb_id_is_the_run_folder_s_kept_by_a_requeue_new_elsewhere_or_restarted(
    tmp_path,
):
    here, there = tmp_path / "here", tmp_path / "there"
    runs = [
        ("same", [*OFFLINE, f"log.root={here}", "train.resilience.exit_after_steps=2"]),  # requeued
        ("same", [*OFFLINE, f"log.root={here}"]),  # the requeue: resumes at step 2
        ("same", [*OFFLINE, f"log.root={there}"]),  # the same name in another folder
        ("same", [*OFFLINE, f"log.root={here}"], "none"),  # a restart from scratch
    ]
    run_ranks(train_runs, 1, str(tmp_path), runs)
    assert exits(tmp_path, "same") == [str(EXIT_REQUEUE), "0", "0", "0"]
    # the id files say which run is which: the first run's was superseded by the restart
    superseded = list((here / "same" / "superseded").glob(f"*/{WANDB_ID}"))
    (first,) = [p.read_text().strip() for p in superseded]
    restarted = (here / "same" / WANDB_ID).read_text().strip()
    # wandb's offline folders carry the start second and the id: two runs started in one
    # second sort by id, so compare them as a multiset, not in order
    logged = sorted(wandb_ids(here / "same"))
    assert logged == sorted([first, first, restarted])  # the requeue logs to the first run
    assert restarted != first  # --resume none: a new run
    (elsewhere,) = wandb_ids(there / "same")
    assert elsewhere not in (first, restarted)  # another folder, another run


@pytest.fixture
def no_credentials(tmp_path, monkeypatch) -> Path:
    """A home without wandb credentials (no key in the environment, no .netrc)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_online_uses_the_netrc_that_wandb_login_writes(no_credentials, capsys):
    netrc = no_credentials / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    assert wandb_mode("online", Path("run")) == "online"
    assert capsys.readouterr().err == ""


def test_online_without_credentials_says_once_that_it_logs_offline(no_credentials, capsys):
    assert wandb_mode("online", Path("run")) == "offline"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "log.wandb_mode=online but no W&B API key found" in said[0]
    assert "wandb sync run/wandb/offline-run-*" in said[0]
    assert wandb_mode("offline", Path("run")) == "offline"
    assert capsys.readouterr().err == ""
