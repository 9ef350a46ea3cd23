"""Checkpoint hashing that scales: each rank hashes the files it wrote (xxh3-128), rank 0
gathers the digests into the one manifest; verification at resume and before retention
splits the files across the ranks; a flipped byte in any rank's file is refused, and
retention never counts a folder whose bytes do not match its manifest.

Which rank hashed which file is observed, not inferred: each rank's
``cqk_megatron.run.file_hash.file_digest`` is wrapped to log every path it hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from _multiproc import run_ranks
from _training import attempts, train_attempts

from cqk_megatron.run import checkpoint_files
from cqk_megatron.run.checkpoint_files import CheckpointError, retire, verify, write_manifest

RUN = "h"
COMMON = [
    "train.eval_interval=100",
    "train.checkpoint.save_interval=2",
    "train.checkpoint.keep_last=2",
    "train.checkpoint.hashes=true",
]
FLIP = "flip a byte"  # a plan entry (FLIP, path relative to the root): rank 0 flips one byte
MARK = "## "  # a line in a rank's hash log: the plan entry that follows
RANK1_SHARD = "engine/pp0/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK0_SHARD = "model/__0_0.distcp"


def _flip_byte(path: Path) -> None:
    """One byte changed in the middle of ``path``: same size, other contents."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def hashing_attempts(rank, world_size, port, root, plan) -> None:
    """``train_attempts`` for each entry of ``plan`` in turn (or a byte flip), with every
    file this rank hashes logged to ``root/hashed.rank<r>.txt`` (a ``MARK`` line before
    each entry)."""
    import torch.distributed as dist

    from cqk_megatron.run import file_hash

    log = Path(root, f"hashed.rank{rank}.txt")
    original = file_hash.file_digest

    def logged(path, algorithm):
        with log.open("a") as handle:
            handle.write(f"{path}\n")
        return original(path, algorithm)

    file_hash.file_digest = logged
    for index, entry in enumerate(plan):
        with log.open("a") as handle:
            handle.write(f"{MARK}{index}\n")
        if entry[0] == FLIP:
            if rank == 0:
                _flip_byte(Path(root, entry[1]))
            dist.barrier()
            continue
        train_attempts(rank, world_size, port, root, [entry])


def _hashed(root: Path, rank: int) -> list[list[str]]:
    """The paths rank ``rank`` hashed, one list per plan entry."""
    parts: list[list[str]] = []
    for line in (root / f"hashed.rank{rank}.txt").read_text().splitlines():
        if line.startswith(MARK):
            parts.append([])
        else:
            parts[-1].append(line)
    return parts


def _under(paths: list[str], folder: Path) -> set[str]:
    """The paths under ``folder``, relative to it."""
    prefix = f"{folder}/"
    return {p[len(prefix) :] for p in paths if p.startswith(prefix)}


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hashing")
    checkpoints = f"{RUN}/checkpoints"
    plan = [
        (RUN, [*COMMON, "train.train_steps=6"]),  # saves 2, 4, 6; retention deletes 2
        (FLIP, f"{checkpoints}/iter_0000006/{RANK1_SHARD}"),
        (RUN, [*COMMON, "train.train_steps=8"]),  # refuses 6, resumes from 4, saves 6, 8
        (FLIP, f"{checkpoints}/iter_0000008/{RANK0_SHARD}"),
        (RUN, [*COMMON, "train.train_steps=10"]),  # refuses 8, resumes from 6
    ]
    run_ranks(hashing_attempts, 2, str(root), plan, timeout_s=900)
    return root


def test_each_rank_hashes_the_files_it_wrote_and_the_manifest_holds_them_all(runs):
    staging = runs / RUN / "checkpoints" / "iter_0000006.tmp"
    first = 0  # the first plan entry: the save of step 6
    by_rank0 = _under(_hashed(runs, 0)[first], staging)
    by_rank1 = _under(_hashed(runs, 1)[first], staging)
    # rank 1 wrote its ZeRO optimizer shard and its trainer state; the weights are
    # replicated across data-parallel ranks, so Megatron writes them from rank 0 only
    assert by_rank1 == {RANK1_SHARD, "trainer/rank1.pt"}
    assert not by_rank0 & by_rank1  # nothing hashed twice
    assert {"trainer/rank0.pt", RANK0_SHARD, "config.yaml", "layout.json"} <= by_rank0
    assert "engine/pp0/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt" in by_rank0
    # every file is in the manifest (the newest one's: each save writes the same names)
    manifest = _manifest(runs / RUN / "checkpoints" / "iter_0000010")
    assert manifest["hash"] == "xxh3_128"
    assert set(manifest["files"]) == by_rank0 | by_rank1
    assert all(len(entry["xxh3_128"]) == 32 for entry in manifest["files"].values())


def test_retention_hashes_the_kept_folder_across_ranks(runs):
    kept = runs / RUN / "checkpoints" / "iter_0000004"
    first = 0  # at the save of step 6, iter_0000004 is verified before iter_0000002 goes
    share0 = _under(_hashed(runs, 0)[first], kept)
    share1 = _under(_hashed(runs, 1)[first], kept)
    assert share0 and share1 and not share0 & share1
    assert share0 | share1 == set(_manifest(kept.with_name("iter_0000010"))["files"])


def test_a_flipped_byte_in_rank1s_file_is_refused_and_the_previous_one_used(runs):
    _check_refused_and_resumed(runs, 2, 6, RANK1_SHARD, 4)


def test_a_flipped_byte_in_rank0s_file_is_refused_and_the_previous_one_used(runs):
    _check_refused_and_resumed(runs, 4, 8, RANK0_SHARD, 6)


def _check_refused_and_resumed(runs, entry, refused, flipped, resumed) -> None:
    attempt = attempts(runs, RUN)[entry // 2]
    assert attempt.get("exit") == 0, attempt
    bad = runs / RUN / "checkpoints" / f"iter_{refused:07d}"
    assert f"skipping checkpoint: {bad}/{flipped}: contents do not match" in attempt["stderr"]
    assert "xxh3_128" in attempt["stderr"]
    good = bad.with_name(f"iter_{resumed:07d}")
    assert f"resumed from {good} at step {resumed} (exactly)" in attempt["stdout"]
    # both ranks hashed a share of each folder verified at the resume: of the refused one
    # (whole, then its weights alone; a folder of its name is saved again later) and of
    # the one resumed from, verified once, every file by one rank
    assert all(_under(_hashed(runs, r)[entry], bad) for r in (0, 1))
    shares = [_under(_hashed(runs, r)[entry], good) for r in (0, 1)]
    assert all(shares) and not shares[0] & shares[1], shares
    assert shares[0] | shares[1] == set(
        _manifest(runs / RUN / "checkpoints" / "iter_0000010")["files"]
    )


# -- torch-free: manifests, old and new, and retention --------------------------------------


def _folder(checkpoints: Path, step: int, size: int = 4096) -> Path:
    folder = checkpoints / f"iter_{step:07d}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "w.bin").write_bytes(bytes((step * 7 + i) % 251 for i in range(size)))
    (folder / "trainer.pt").write_bytes(b"trainer %d" % step)
    return folder


def test_retention_counts_only_folders_that_verify_by_hash(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        write_manifest(_folder(checkpoints, step), step, with_hashes=True)
    _flip_byte(checkpoints / "iter_0000006" / "model" / "w.bin")  # the right size, bad bytes
    fresh = _folder(checkpoints, 10)
    write_manifest(fresh, 10, with_hashes=True)
    deleted = retire(checkpoints, keep=3, just_written=fresh)
    left = checkpoint_files.iterations(checkpoints)
    good = []
    for folder in left:
        try:
            verify(folder)
            good.append(folder.name)
        except CheckpointError:
            pass
    # iter_0000006 does not count: 10, 8 and 4 are the three kept, only 2 goes
    assert [p.name for p in deleted] == ["iter_0000002"]
    assert good == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert len(good) >= 3


def test_a_manifest_written_with_sha256_still_verifies_and_catches_a_flipped_byte(tmp_path):
    folder = _folder(tmp_path / "checkpoints", 4)
    files = {
        str(p.relative_to(folder)): {
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    (folder / "manifest.json").write_text(json.dumps({"step": 4, "files": files}))  # no "hash"
    assert verify(folder) == 4
    _flip_byte(folder / "model" / "w.bin")
    with pytest.raises(CheckpointError, match="w.bin: contents do not match the manifest's sha256"):
        verify(folder)
    assert verify(folder, hashes=False) == 4  # sizes still match


def test_a_manifest_of_an_unknown_hash_is_refused_naming_it(tmp_path):
    folder = _folder(tmp_path / "checkpoints", 2)
    write_manifest(folder, 2, with_hashes=True)
    manifest = _manifest(folder)
    manifest["hash"] = "md4"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="hashed with 'md4', which this version does not"):
        verify(folder)


def test_hash_shares_split_every_file_once_and_balance_the_bytes():
    sizes = {f"f{i}": size for i, size in enumerate([900, 500, 400, 300, 200, 100, 100])}
    shares = [checkpoint_files.hash_share(sizes, r, 3) for r in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) <= 900  # the largest file alone, no more
    assert checkpoint_files.hash_share(sizes, 0, 1) == sorted(sizes)
