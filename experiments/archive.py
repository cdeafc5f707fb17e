"""One archive of a results folder, for a machine that hands back only a few files per command.

`pack` writes `<tag>.tar.gz` (the whole folder, under its own name, so unpacking it into `results/` restores
`results/<tag>/`) and copies the two summaries beside it, so a reader sees the verdicts without unpacking. Every
file is written under a temporary name and renamed, so a kill mid-write leaves the previous complete archive.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

SUMMARIES = ("gpu_check.json", "gpu_mfu.json")


def target(path: str | None, tag: str) -> Path | None:
    """Where `--archive PATH` puts the archive: PATH itself, or `PATH/<tag>.tar.gz` for a folder (an existing one,
    or a name ending in '/'); None without PATH."""
    if not path:
        return None
    if path.endswith(("/", os.sep)) or Path(path).is_dir():
        return Path(path) / f"{tag}.tar.gz"
    if not path.endswith((".tar.gz", ".tgz")):
        raise ValueError(f"--archive {path!r}: name a folder or a .tar.gz file")
    return Path(path)


def pack(folder: Path, archive: Path) -> list[Path]:
    """Writes `archive` from `folder` and copies its summaries next to it; returns the files written."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.name.endswith(".tmp"):
                tar.add(path, arcname=f"{folder.name}/{path.name}")
    os.replace(tmp, archive)
    written = [archive]
    for name in SUMMARIES:
        src = folder / name
        if src.is_file() and src.parent.resolve() != archive.parent.resolve():
            dest = archive.parent / name
            shutil.copyfile(src, dest.with_name(name + ".tmp"))
            os.replace(dest.with_name(name + ".tmp"), dest)
            written.append(dest)
    return written
