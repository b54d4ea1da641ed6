"""A rows pass of a shape (2 layers; default Llama-3-8B) and a token step, replayed, for ncu's
per-kernel durations (where a few-row pass spends its time beside the weight products).

    ncu --metrics gpu__time_duration.sum --csv python scripts/kernels/rows_pass_profile.py fp16 8
    ncu ... python scripts/kernels/rows_pass_profile.py fp16 8 qwen2.5-1.5b
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import RandomDeviceModel, config_for  # noqa: E402

from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402

dtype, n = sys.argv[1], int(sys.argv[2])
shape = sys.argv[3] if len(sys.argv) > 3 else "llama3-8b"
cfg = dataclasses.replace(config_for(shape, dtype, 4096), n_layers=2)
engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=EngineOptions())
ids = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, n)]
engine.forward_rows(ids, 128)  # compiles and captures
engine.forward_rows(ids, 128)
step = engine.graph(SamplingParams(), 128)
engine._set_state(1, 128, 0)
step.launch()
engine.stream.synchronize()
print("PROFILE-START", flush=True)
engine.forward_rows(ids, 128)  # the replay ncu reads
engine._set_state(1, 128, 0)
step.launch()
engine.stream.synchronize()
