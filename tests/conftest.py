import os

import torch
from hypothesis import HealthCheck, settings

# Triton kernels run on the CPU under the interpreter when no GPU is present; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "int8kv", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("int8kv")
