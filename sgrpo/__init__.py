"""sgrpo: GRPO-family RL for language models on PyTorch Lightning.

The distribution installs three top-level packages: ``sgrpo`` (the engine), ``estimators`` and ``tasks``
(the public faces users subclass). Generic names can collide: a project's own ``tasks`` folder in the
working directory, or another distribution's, would be imported in place of sgrpo's and fail later in
confusing ways. Importing sgrpo checks that both resolve beside it, and says which file shadows them: in
one line and exit 2 from ``python -m sgrpo.<command>``, an ImportError to a program that imports it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

COMPANIONS = ("estimators", "tasks")


def check_companions() -> None:
    """Raise ImportError unless ``estimators`` and ``tasks`` are the packages installed with sgrpo."""
    home = Path(__file__).resolve().parent.parent
    for name in COMPANIONS:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin or next(iter(spec.submodule_search_locations or []), None)
        where = None if origin is None else Path(origin).resolve()
        if where is None or home not in where.parents:
            raise ImportError(
                f"sgrpo's '{name}' package is shadowed: '{name}' resolves to {where or 'nothing'}, "
                f"not to {home / name}. Rename the other '{name}' (a folder in the working directory or another "
                f"distribution's) or run from another directory: sgrpo imports its own as top-level '{name}'."
            )


try:
    check_companions()
except ImportError as err:
    if sys.argv[:1] != ["-m"]:  # imported by a program: its ImportError
        raise
    sys.stderr.write(f"error: {err}\n")  # `python -m sgrpo.fit` (argv[0] is "-m" while Python finds the module)
    raise SystemExit(2) from None
