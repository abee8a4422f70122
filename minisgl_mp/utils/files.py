from __future__ import annotations

import shutil
import uuid
from pathlib import Path


def replace_dir(staging: Path, out: Path) -> None:
    """Renames a finished `staging` folder to `out`, replacing what is there."""
    # NOTE: a directory rename cannot replace a non-empty directory, so an old build is moved
    # aside first; between the two renames `out` is briefly absent, never half-written.
    if out.exists():
        retired = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(retired)
        staging.rename(out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(out)
