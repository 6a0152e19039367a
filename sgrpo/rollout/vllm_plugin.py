"""sgrpo's vLLM plugin: registers the ``sgrpo_cpu`` weight-transfer backend in every vLLM process.

vLLM calls ``register`` in each of its processes (the API server and its workers) through the
``vllm.general_plugins`` entry point in sgrpo's pyproject.toml, once sgrpo is installed in the server's
environment. The registration is lazy (a module path): vLLM imports ``sgrpo.rollout.vllm_cpu_engine`` only
when a server is started with ``--weight-transfer-config '{"backend": "sgrpo_cpu"}'``.
"""

from __future__ import annotations

#: the backend name servers are started with (``--weight-transfer-config``) and ``CPUTransport`` uses
CPU_BACKEND = "sgrpo_cpu"


def register() -> None:
    """Register ``sgrpo_cpu`` with vLLM's weight-transfer factory (idempotent: vLLM may call plugins twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if CPU_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            CPU_BACKEND, "sgrpo.rollout.vllm_cpu_engine", "CPUWeightTransferEngine"
        )
