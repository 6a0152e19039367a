"""Run by test_faults.py in a fresh interpreter: ``sgrpo.fit`` whose write of ``last.ckpt`` at one step stalls.

fault_worker.py STEP MARKER FIT_ARGS...   the write of last.ckpt at global step STEP writes half of its
                                          bytes, creates MARKER and hangs there (the test kills it)
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def stall_at(step: int, marker: Path) -> None:
    save = torch.save

    def stalling_save(obj, f, *args, **kwargs):
        into_last = "last" in str(getattr(f, "name", ""))  # a file (not a buffer) that becomes last.ckpt
        if into_last and isinstance(obj, dict) and obj.get("global_step") == step:
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            marker.touch()
            time.sleep(600)
        return save(obj, f, *args, **kwargs)

    torch.save = stalling_save


if __name__ == "__main__":
    stall_at(int(sys.argv[1]), Path(sys.argv[2]))
    from sgrpo.fit import main

    main(sys.argv[3:])
