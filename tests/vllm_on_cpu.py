"""vLLM's CPU platform for the tests that drive vLLM's own classes; import it before vLLM.

scripts/install-peers.sh installs vLLM's CUDA wheel without its dependencies, so
VLLM_TARGET_DEVICE tells vLLM to take its CPU platform. From 0.34 that platform refuses an x86
CPU without triton-cpu (built from source, not on PyPI); the connector, config and scheduler
classes these tests drive run no Triton kernel, so the check is told Triton is there.
"""

import contextlib
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the simulation's tiny model config is a local file

with contextlib.suppress(ImportError):  # no vLLM (or torch): the tests skip themselves
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True
